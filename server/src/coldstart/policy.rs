//! `--cold-start`: what a request whose adapter is not on the device does.
use std::fmt;

/// The cold-start policies (DESIGN §4).
#[derive(
    Copy,
    Clone,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum ColdStartPolicy {
    /// The oracle: every adapter made resident before serving starts.
    Cached,
    /// A request waits until its adapter is fully resident; others keep running
    /// (Punica, S-LoRA).
    OnDemand,
    /// Always assist on the CPU while any layer has not landed (CaraServe).
    CpuAssist,
    /// The cost model decides per step: wait, assist, or assist with a smaller chunk.
    #[default]
    Auto,
}

impl ColdStartPolicy {
    pub const ALL: [ColdStartPolicy; 4] = [
        ColdStartPolicy::Cached,
        ColdStartPolicy::OnDemand,
        ColdStartPolicy::CpuAssist,
        ColdStartPolicy::Auto,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ColdStartPolicy::Cached => "cached",
            ColdStartPolicy::OnDemand => "on-demand",
            ColdStartPolicy::CpuAssist => "cpu-assist",
            ColdStartPolicy::Auto => "auto",
        }
    }
}

impl fmt::Display for ColdStartPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
