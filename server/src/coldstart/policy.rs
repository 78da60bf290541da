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

    /// Whether a request's adapter found only on disk (a miss) is served from its
    /// memory-mapped file while the loader reads it ([`crate::memory::mapped`]): the upload
    /// pipeline reads it layer by layer into the arena and queues each layer's copy as soon as
    /// it is read and checked, instead of after the loader's whole read. Every policy:
    /// - `cached` still starts the request only once every layer has landed (its gate holds
    ///   it), so only the read becomes layer by layer, overlapped with the copy;
    /// - `on-demand`, and `auto` where it waits: waiting for the layers from the file is never
    ///   slower than waiting for the loader's queue and whole read first (a property of
    ///   [`crate::perf::LayerLanding`], the copy path `auto` models);
    /// - `cpu-assist`, and `auto` where it assists: the workers compute from the same file.
    ///
    /// The server's memory step and the engine-level driver (`driver.rs`) both ask it, so
    /// they choose alike; the match is exhaustive so a new policy decides.
    pub fn serves_disk_miss_from_file(self) -> bool {
        match self {
            ColdStartPolicy::Cached
            | ColdStartPolicy::OnDemand
            | ColdStartPolicy::CpuAssist
            | ColdStartPolicy::Auto => true,
        }
    }

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
