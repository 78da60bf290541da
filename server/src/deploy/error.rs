use std::path::PathBuf;

/// What can go wrong reading the topology or planning the instances.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot parse `{text}` as a CPU list (like 0-3,8-11)")]
    CpuList { path: PathBuf, text: String },
    #[error(
        "no NVIDIA GPU found under {0} (PCI vendor 0x10de, class 0x0300xx or 0x0302xx); \
         is the driver loaded, and is this the right --sysfs-root?"
    )]
    NoGpu(PathBuf),
    #[error(
        "no CPU found under {0} (devices/system/node/node*/cpulist or devices/system/cpu/online)"
    )]
    NoCpu(PathBuf),
    #[error("--gpus names GPU {index}, but this machine has {count} (0..{count})")]
    NoSuchGpu { index: usize, count: usize },
    #[error("GPU {gpu} is on NUMA node {node}, which has no cores listed")]
    EmptyNode { gpu: usize, node: u32 },
    #[error(
        "NUMA node {node} has {cores} core(s) for {gpus} GPU(s); each instance needs at least one"
    )]
    TooFewCores {
        node: u32,
        cores: usize,
        gpus: usize,
    },
}
