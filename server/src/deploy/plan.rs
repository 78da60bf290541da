//! The launch plan: one `thaw serve` per GPU, bound to the GPU's NUMA node. GPUs sharing a
//! node split its cores into disjoint contiguous slices (then `numactl --physcpubind` names
//! the slice); a GPU alone on its node gets the whole node (`--cpunodebind`). Memory is always
//! bound to the node (`--membind`): the host adapter store and the workers' reads stay local.
use std::fmt::Write as _;
use std::path::PathBuf;

use super::topology::{format_cpulist, Gpu, Topology};
use super::DeployError;

/// How to launch the instances.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub thaw_bin: PathBuf,
    pub numactl: PathBuf,
    pub host: String,
    /// Instance i listens on `base_port + i`.
    pub base_port: u16,
    /// At most this many CPU LoRA workers per instance [None: every core but the engine's].
    pub max_lora_workers: Option<usize>,
    /// Only these GPU indices [None: all].
    pub gpus: Option<Vec<usize>>,
    /// Appended to every `thaw serve` command line.
    pub serve_args: Vec<String>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            thaw_bin: PathBuf::from("thaw"),
            numactl: PathBuf::from("numactl"),
            host: "127.0.0.1".into(),
            base_port: 8000,
            max_lora_workers: None,
            gpus: None,
            serve_args: Vec::new(),
        }
    }
}

/// One planned `thaw serve`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    pub gpu: Gpu,
    pub node: u32,
    /// The instance's cores: the first runs the engine, the next `lora_workers` the workers.
    pub cores: Vec<usize>,
    /// The cores are the whole node (bind with --cpunodebind rather than --physcpubind).
    pub whole_node: bool,
    pub port: u16,
    pub lora_workers: usize,
    pub env: Vec<(String, String)>,
    /// The full command line, numactl first.
    pub argv: Vec<String>,
}

/// Plans one instance per (selected) GPU.
pub fn plan(topo: &Topology, opts: &PlanOptions) -> Result<Vec<Instance>, DeployError> {
    let selected: Vec<&Gpu> = match &opts.gpus {
        None => topo.gpus.iter().collect(),
        Some(ix) => ix
            .iter()
            .map(|&i| {
                topo.gpus.get(i).ok_or(DeployError::NoSuchGpu {
                    index: i,
                    count: topo.gpus.len(),
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let node_of = |g: &Gpu| g.numa_node.unwrap_or(topo.nodes[0].id);
    let mut out = Vec::with_capacity(selected.len());
    for (i, g) in selected.iter().enumerate() {
        let node_id = node_of(g);
        let cpus = topo
            .nodes
            .iter()
            .find(|n| n.id == node_id)
            .map(|n| n.cpus.clone())
            .unwrap_or_default();
        if cpus.is_empty() {
            return Err(DeployError::EmptyNode {
                gpu: g.index,
                node: node_id,
            });
        }
        // This GPU's slice among the selected GPUs on the same node, in GPU order.
        let peers: Vec<usize> = selected
            .iter()
            .filter(|p| node_of(p) == node_id)
            .map(|p| p.index)
            .collect();
        let k = peers.len();
        if cpus.len() < k {
            return Err(DeployError::TooFewCores {
                node: node_id,
                cores: cpus.len(),
                gpus: k,
            });
        }
        let slot = peers.iter().position(|&p| p == g.index).unwrap_or(0);
        let (base, extra) = (cpus.len() / k, cpus.len() % k);
        let start = slot * base + slot.min(extra);
        let len = base + usize::from(slot < extra);
        let cores = cpus[start..start + len].to_vec();
        let whole_node = k == 1;
        let lora_workers = (cores.len() - 1).min(opts.max_lora_workers.unwrap_or(usize::MAX));
        let port = opts.base_port.saturating_add(i as u16);
        let mut argv = vec![opts.numactl.display().to_string()];
        if whole_node {
            argv.push(format!("--cpunodebind={node_id}"));
        } else {
            argv.push(format!("--physcpubind={}", format_cpulist(&cores)));
        }
        argv.push(format!("--membind={node_id}"));
        argv.extend([
            opts.thaw_bin.display().to_string(),
            "serve".into(),
            "--host".into(),
            opts.host.clone(),
            "--port".into(),
            port.to_string(),
            "--lora-workers".into(),
            lora_workers.to_string(),
        ]);
        argv.extend(opts.serve_args.iter().cloned());
        out.push(Instance {
            gpu: (*g).clone(),
            node: node_id,
            cores,
            whole_node,
            port,
            lora_workers,
            env: vec![
                ("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()),
                ("CUDA_VISIBLE_DEVICES".into(), g.index.to_string()),
            ],
            argv,
        });
    }
    Ok(out)
}

/// Shell-quotes `s` when it needs it.
fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_=./,:@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

impl Instance {
    /// The command as one shell line, environment first.
    pub fn shell_line(&self) -> String {
        let env = self.env.iter().map(|(k, v)| format!("{k}={}", quote(v)));
        env.chain(self.argv.iter().map(|a| quote(a)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The topology and the plan, as `--dry-run` prints them.
pub fn render_plan(topo: &Topology, instances: &[Instance]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "topology (sysfs at {}): {} NUMA node(s), {} NVIDIA GPU(s)",
        topo.sysfs_root.display(),
        topo.nodes.len(),
        topo.gpus.len()
    );
    for n in &topo.nodes {
        let _ = writeln!(
            s,
            "  node {}: cores {} ({})",
            n.id,
            format_cpulist(&n.cpus),
            n.cpus.len()
        );
    }
    for g in &topo.gpus {
        let node = g
            .numa_node
            .map_or_else(|| "unknown".to_string(), |n| n.to_string());
        let _ = writeln!(s, "  GPU {}: {} on node {node}", g.index, g.pci);
    }
    for note in &topo.notes {
        let _ = writeln!(s, "  note: {note}");
    }
    let _ = writeln!(s, "plan: {} instance(s)", instances.len());
    for (i, inst) in instances.iter().enumerate() {
        let workers = if inst.lora_workers == 0 {
            "no LoRA workers (assist on the engine thread)".to_string()
        } else {
            format!(
                "{} LoRA worker(s) on {}",
                inst.lora_workers,
                format_cpulist(&inst.cores[1..=inst.lora_workers])
            )
        };
        let _ = writeln!(
            s,
            "  instance {i}: GPU {} ({}) -> node {}, cores {}{}: engine on {}, {workers}; port {}",
            inst.gpu.index,
            inst.gpu.pci,
            inst.node,
            format_cpulist(&inst.cores),
            if inst.whole_node { " (whole node)" } else { "" },
            inst.cores[0],
            inst.port
        );
        let _ = writeln!(s, "    {}", inst.shell_line());
    }
    s
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::read_topology;
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/fixtures/sysfs")
            .join(name)
    }

    fn dry_run(name: &str, opts: &PlanOptions) -> Result<(Vec<Instance>, String), DeployError> {
        let mut topo = read_topology(&fixture(name))?;
        topo.fill_unknown_nodes(&[]);
        let p = plan(&topo, opts)?;
        let text = render_plan(&topo, &p);
        Ok((p, text))
    }

    #[test]
    fn one_socket_splits_the_node_between_its_gpus() {
        // 1 node (cores 0-7), 2 GPUs whose sysfs numa_node is -1.
        let (p, text) = dry_run("one-socket", &PlanOptions::default()).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].node, p[1].node), (0, 0));
        assert_eq!(p[0].cores, vec![0, 1, 2, 3]);
        assert_eq!(p[1].cores, vec![4, 5, 6, 7]);
        assert_eq!((p[0].lora_workers, p[0].port, p[1].port), (3, 8000, 8001));
        assert_eq!(
            p[1].shell_line(),
            "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1 numactl --physcpubind=4-7 \
             --membind=0 thaw serve --host 127.0.0.1 --port 8001 --lora-workers 3"
        );
        assert!(text.contains("node 0, the machine's only node"), "{text}");
        assert!(
            text.contains("engine on 4, 3 LoRA worker(s) on 5-7"),
            "{text}"
        );
    }

    #[test]
    fn two_sockets_bind_the_gpu_to_node_1() {
        // 2 nodes (0-7 + 16-23, 8-15 + 24-31); the GPU (and its audio function) on node 1.
        let opts = PlanOptions {
            max_lora_workers: Some(4),
            serve_args: vec!["--model".into(), "/models/llama".into()],
            ..Default::default()
        };
        let (p, text) = dry_run("two-socket", &opts).unwrap();
        assert_eq!(p.len(), 1, "the audio function is not a GPU:\n{text}");
        assert_eq!(p[0].gpu.pci, "0000:af:00.0");
        assert_eq!(p[0].node, 1);
        assert!(p[0].whole_node);
        assert_eq!(p[0].cores.len(), 16);
        assert_eq!(p[0].cores[..2], [8, 9]);
        assert_eq!(p[0].lora_workers, 4);
        assert!(text.contains(
            "CUDA_VISIBLE_DEVICES=0 numactl --cpunodebind=1 --membind=1 thaw serve --host \
             127.0.0.1 --port 8000 --lora-workers 4 --model /models/llama"
        ));
        assert!(
            text.contains("engine on 8, 4 LoRA worker(s) on 9-12"),
            "{text}"
        );
        assert!(text.contains("node 1: cores 8-15,24-31 (16)"), "{text}");
    }

    #[test]
    fn four_gpus_on_two_sockets_and_gpu_selection() {
        let (p, _) = dry_run("two-socket-four-gpu", &PlanOptions::default()).unwrap();
        let nodes: Vec<u32> = p.iter().map(|i| i.node).collect();
        assert_eq!(nodes, vec![0, 0, 1, 1]);
        assert_eq!(p[2].cores, (32..48).collect::<Vec<_>>());
        assert_eq!(p[3].cores, (48..64).collect::<Vec<_>>());
        // No two instances share a core.
        let mut all: Vec<usize> = p.iter().flat_map(|i| i.cores.clone()).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
        // One GPU alone gets its whole node.
        let one = PlanOptions {
            gpus: Some(vec![3]),
            ..Default::default()
        };
        let (p, _) = dry_run("two-socket-four-gpu", &one).unwrap();
        assert_eq!((p.len(), p[0].node, p[0].cores.len()), (1, 1, 32));
        assert!(p[0].argv.contains(&"--cpunodebind=1".to_string()));
        let bad = PlanOptions {
            gpus: Some(vec![4]),
            ..Default::default()
        };
        assert!(matches!(
            dry_run("two-socket-four-gpu", &bad),
            Err(DeployError::NoSuchGpu { index: 4, count: 4 })
        ));
    }

    #[test]
    fn no_gpu_is_a_clear_error() {
        let e = dry_run("no-gpu", &PlanOptions::default()).unwrap_err();
        assert!(matches!(e, DeployError::NoGpu(_)));
        assert!(e.to_string().contains("no NVIDIA GPU found"), "{e}");
    }
}
