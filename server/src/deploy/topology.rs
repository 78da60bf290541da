//! Reading the machine's topology from sysfs (a root other than `/sys` for tests) and from
//! `nvidia-smi topo -m` when sysfs does not say (`numa_node` is -1 on single-node kernels and
//! some VMs).
use std::path::{Path, PathBuf};

use super::DeployError;

/// An NVIDIA GPU. `index` is its CUDA index under `CUDA_DEVICE_ORDER=PCI_BUS_ID` (GPUs sorted
/// by PCI address), which is also nvidia-smi's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub index: usize,
    pub pci: String,
    /// None when sysfs says -1 and nothing else told us.
    pub numa_node: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub sysfs_root: PathBuf,
    pub nodes: Vec<NumaNode>,
    pub gpus: Vec<Gpu>,
    /// How GPUs without a sysfs node got one, for the plan's notes.
    pub notes: Vec<String>,
}

fn read(path: &Path) -> Result<String, DeployError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| DeployError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// `0-3,8-11` → [0, 1, 2, 3, 8, 9, 10, 11]. An empty list is empty (memory-only nodes).
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.trim().is_empty()) {
        let part = part.trim();
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// [0, 1, 2, 5] → `0-2,5`.
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

fn cpulist_file(path: &Path) -> Result<Vec<usize>, DeployError> {
    let text = read(path)?;
    parse_cpulist(&text).ok_or_else(|| DeployError::CpuList {
        path: path.to_path_buf(),
        text,
    })
}

/// Reads NUMA nodes and NVIDIA GPUs under `sysfs_root` (normally `/sys`).
pub fn read_topology(sysfs_root: &Path) -> Result<Topology, DeployError> {
    let nodes = read_nodes(sysfs_root)?;
    let pci_dir = sysfs_root.join("bus/pci/devices");
    let entries = std::fs::read_dir(&pci_dir).map_err(|source| DeployError::Io {
        path: pci_dir.clone(),
        source,
    })?;
    let mut found: Vec<(String, Option<u32>)> = Vec::new();
    for e in entries.flatten() {
        let dev = e.path();
        let (Ok(vendor), Ok(class)) = (read(&dev.join("vendor")), read(&dev.join("class"))) else {
            continue;
        };
        // 0x0300xx VGA controller, 0x0302xx 3D controller (data-centre GPUs); not audio etc.
        let is_gpu = vendor.eq_ignore_ascii_case("0x10de")
            && (class.starts_with("0x0300") || class.starts_with("0x0302"));
        if !is_gpu {
            continue;
        }
        let node = read(&dev.join("numa_node"))
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        found.push((e.file_name().to_string_lossy().into_owned(), node));
    }
    if found.is_empty() {
        return Err(DeployError::NoGpu(pci_dir));
    }
    found.sort();
    let gpus = found
        .into_iter()
        .enumerate()
        .map(|(index, (pci, numa_node))| Gpu {
            index,
            pci,
            numa_node,
        })
        .collect();
    Ok(Topology {
        sysfs_root: sysfs_root.to_path_buf(),
        nodes,
        gpus,
        notes: Vec::new(),
    })
}

fn read_nodes(root: &Path) -> Result<Vec<NumaNode>, DeployError> {
    let node_dir = root.join("devices/system/node");
    let mut nodes = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&node_dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name
                .strip_prefix("node")
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            nodes.push(NumaNode {
                id,
                cpus: cpulist_file(&e.path().join("cpulist"))?,
            });
        }
    }
    if nodes.is_empty() {
        // A kernel without NUMA support: one node with every online CPU.
        let online = root.join("devices/system/cpu/online");
        if online.exists() {
            nodes.push(NumaNode {
                id: 0,
                cpus: cpulist_file(&online)?,
            });
        }
    }
    nodes.sort_by_key(|n| n.id);
    if nodes.iter().all(|n| n.cpus.is_empty()) {
        return Err(DeployError::NoCpu(root.to_path_buf()));
    }
    Ok(nodes)
}

/// One GPU row of `nvidia-smi topo -m`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SmiTopoRow {
    pub gpu: usize,
    pub cpus: Option<Vec<usize>>,
    pub numa_node: Option<u32>,
}

/// Parses `nvidia-smi topo -m`: the tab-separated matrix whose header names the `CPU Affinity`
/// and `NUMA Affinity` columns (ANSI underline codes stripped). Cells like `N/A` become None.
pub fn parse_nvidia_smi_topo(text: &str) -> Vec<SmiTopoRow> {
    let clean = strip_ansi(text);
    let mut lines = clean.lines();
    let Some(header) = lines.find(|l| l.contains("CPU Affinity")) else {
        return Vec::new();
    };
    let cols: Vec<&str> = header.split('\t').map(str::trim).collect();
    let col = |name: &str| cols.iter().position(|c| *c == name);
    let (cpu_col, numa_col) = (col("CPU Affinity"), col("NUMA Affinity"));
    let mut rows = Vec::new();
    for line in lines {
        let fields: Vec<&str> = line.split('\t').map(str::trim).collect();
        let Some(gpu) = fields
            .first()
            .and_then(|f| f.strip_prefix("GPU"))
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        let at = |c: Option<usize>| c.and_then(|c| fields.get(c)).copied();
        rows.push(SmiTopoRow {
            gpu,
            cpus: at(cpu_col)
                .and_then(parse_cpulist)
                .filter(|c| !c.is_empty()),
            numa_node: at(numa_col).and_then(|s| s.parse().ok()),
        });
    }
    rows
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ ... final byte in @..~
            for d in chars.by_ref() {
                if ('@'..='~').contains(&d) && d != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Topology {
    /// Gives GPUs whose sysfs node is unknown the node nvidia-smi reports, else the only node
    /// when there is one.
    pub fn fill_unknown_nodes(&mut self, smi: &[SmiTopoRow]) {
        let single = (self.nodes.len() == 1).then(|| self.nodes[0].id);
        for g in self.gpus.iter_mut().filter(|g| g.numa_node.is_none()) {
            if let Some(n) = smi
                .iter()
                .find(|r| r.gpu == g.index)
                .and_then(|r| r.numa_node)
            {
                g.numa_node = Some(n);
                self.notes.push(format!(
                    "GPU {} ({}): sysfs numa_node is -1; node {n} from nvidia-smi topo -m",
                    g.index, g.pci
                ));
            } else if let Some(n) = single {
                g.numa_node = Some(n);
                self.notes.push(format!(
                    "GPU {} ({}): sysfs numa_node is -1; node {n}, the machine's only node",
                    g.index, g.pci
                ));
            } else {
                let n = self.nodes[0].id;
                g.numa_node = Some(n);
                self.notes.push(format!(
                    "GPU {} ({}): NUMA node unknown (sysfs -1, no nvidia-smi); assuming node {n}",
                    g.index, g.pci
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_round_trip() {
        assert_eq!(
            parse_cpulist("0-3,8-9,12\n"),
            Some(vec![0, 1, 2, 3, 8, 9, 12])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a"), None);
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 9, 12]), "0-3,8-9,12");
        assert_eq!(format_cpulist(&[]), "");
    }

    #[test]
    fn nvidia_smi_topo_matrix() {
        let text = "\x1b[4m\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n\
                    GPU0\t X \tSYS\tNODE\t0-23,48-71\t0\t\tN/A\n\
                    GPU1\tSYS\t X \tSYS\t24-47,72-95\t1\t\tN/A\n\
                    NIC0\tNODE\tSYS\t X \n\n\
                    Legend:\n\n  X    = Self\n";
        let rows = parse_nvidia_smi_topo(text);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].gpu, 1);
        assert_eq!(rows[1].numa_node, Some(1));
        assert_eq!(rows[1].cpus.as_ref().unwrap().len(), 48);
        assert_eq!(rows[0].cpus.as_ref().unwrap()[24], 48);
        assert!(parse_nvidia_smi_topo("No devices were found").is_empty());
    }
}
