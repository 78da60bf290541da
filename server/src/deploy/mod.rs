//! NUMA-aware deployment (`thaw-numa-launch`): read which NUMA node each NVIDIA GPU hangs off
//! and which cores that node has, then plan one `thaw serve` per GPU bound with `numactl` to
//! its GPU's node (memory and cores), so the engine and its CPU LoRA workers read host memory
//! at local bandwidth. The first core of an instance's set runs the engine; `thaw serve` pins
//! its LoRA workers to the following ones.
mod error;
mod plan;
mod topology;

pub use error::DeployError;
pub use plan::{plan, render_plan, Instance, PlanOptions};
pub use topology::{
    format_cpulist, parse_cpulist, parse_nvidia_smi_topo, read_topology, Gpu, NumaNode, SmiTopoRow,
    Topology,
};
