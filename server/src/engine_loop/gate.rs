//! The cold-start gate the step planner consults for each prefilling request, and what the
//! step then does with its adapter's layers not landed: wait for them in the forward, or
//! compute them on the CPU (per adapter, [`thaw_runtime::engine::UnlandedLayers`]).
use thaw_runtime::engine::UnlandedLayers;
use thaw_runtime::ids::SeqId;

use crate::coldstart::{AssistWork, ColdCase, ColdDecision, ColdStartPolicy, ColdTier};
use crate::perf::DiskQueue;
use crate::scheduler::{Gate, SeqState};

use super::{ColdStart, ServeEngine};

/// A prefilling request's cold-start gate and, when it runs before its adapter has landed,
/// what its step does with that adapter's layers not landed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum ColdGate {
    /// Its adapter is on the device, or it has none: nothing to decide.
    Warm,
    /// It waits for its adapter's copy: no tokens this step.
    Hold,
    /// It runs, at most `cap` prompt tokens (None: as many as the step gives it), the layers
    /// of its adapter not landed waited for or assisted as `unlanded` says.
    Run {
        cap: Option<usize>,
        unlanded: UnlandedLayers,
    },
}

impl ColdGate {
    /// What the step planner sees.
    pub(super) fn gate(self) -> Gate {
        match self {
            ColdGate::Warm | ColdGate::Run { cap: None, .. } => Gate::Go,
            ColdGate::Hold => Gate::Hold,
            ColdGate::Run { cap: Some(c), .. } => Gate::Cap(c),
        }
    }
}

/// The cold-start gate of one prefilling request next to `planned` rows of the step (of at
/// most `max_batched` rows) and the `running` requests: warm when its adapter is resident (or
/// it has none); otherwise as the policy says ([`policy_gate`]). Asked again every step, so
/// an assist stops the step its decision flips, and its chunk is never more than the
/// decision's.
pub(super) fn cold_gate(
    engine: &ServeEngine,
    cold: &ColdStart,
    s: &SeqState,
    planned: usize,
    running: &[SeqState],
    max_batched: usize,
) -> ColdGate {
    let Some(id) = s.adapter else {
        return ColdGate::Warm;
    };
    // Not registered: admission fails with a clear error.
    let (Some((landed, layers)), Some(adapter)) =
        (engine.adapter_landed(id), engine.adapter_host(id))
    else {
        return ColdGate::Warm;
    };
    if landed >= layers {
        return ColdGate::Warm;
    }
    let pending = s.pending();
    // What this step can still give it.
    let cap = pending.min(max_batched.saturating_sub(planned));
    // Whether it may wait for its layers in this step: they lengthen the step by little.
    let in_step = || {
        let tokens = planned + cap;
        super::layer_gate::on_demand(engine, &cold.cost, id, (landed, layers), tokens)
    };
    let decide = || {
        let tier = ColdTier::registered(landed, layers, engine.adapter_is_mapped(id));
        let (running, fewest_left) = beside(running, s.id);
        let case = ColdCase {
            tier,
            bytes: adapter.size_bytes() as u64,
            backlog: engine.backend().link_backlog(),
            reads: DiskQueue::default(),
            work: AssistWork::of(adapter),
            prompt_left: pending,
            // The decision sizes its chunks by it.
            cap,
            other_tokens: planned,
            running,
            fewest_left,
            max_new_tokens: s.max_new_tokens,
        };
        cold.cost.decide_cold(&case).decision
    };
    policy_gate(cold.policy, decide, in_step)
}

/// The gate of a request whose adapter has not fully landed, by policy: `decide` is `auto`'s
/// cost-model decision, `in_step` the layer gate ([`super::layer_gate::on_demand`]: Go when
/// waiting for its layers in the step lengthens the step by at most
/// [`super::layer_gate::MAX_STALL_SHARE`]); each is asked only where the policy needs it.
/// - `cached` holds: its adapters are copied whole (on a GPU through the same asynchronous
///   pipeline as a streamed one, so a freshly registered one has not landed yet) and it never
///   computes a delta on the CPU.
/// - `on-demand` never computes a layer on the CPU: it runs waiting for the layers in the step
///   where the layer gate lets it, and holds otherwise.
/// - `cpu-assist` runs, its adapter's layers not landed computed on the CPU.
/// - `auto` runs assisted, capped, where its cost model chooses CPU assist; where it chooses
///   to wait for the copy, it waits as `on-demand` does: in the step when the layer gate lets
///   it, instead of until every layer landed and then for the next step.
pub(super) fn policy_gate(
    policy: ColdStartPolicy,
    decide: impl FnOnce() -> ColdDecision,
    in_step: impl FnOnce() -> Gate,
) -> ColdGate {
    let wait = |g: Gate| match g {
        Gate::Go => ColdGate::Run {
            cap: None,
            unlanded: UnlandedLayers::Wait,
        },
        Gate::Hold | Gate::Cap(_) => ColdGate::Hold,
    };
    match policy {
        ColdStartPolicy::Cached => ColdGate::Hold,
        ColdStartPolicy::OnDemand => wait(in_step()),
        ColdStartPolicy::CpuAssist => ColdGate::Run {
            cap: None,
            unlanded: UnlandedLayers::Assist,
        },
        ColdStartPolicy::Auto => match decide() {
            ColdDecision::Wait => wait(in_step()),
            ColdDecision::Assist { max_chunk } => ColdGate::Run {
                cap: Some(max_chunk),
                unlanded: UnlandedLayers::Assist,
            },
        },
    }
}

/// Whether a disk-tier adapter is served from its file while it is read (see
/// [`crate::memory::mapped`]): the upload pipeline then reads it layer by layer into the arena
/// and each layer lands as soon as it is read and checked, instead of after the loader's whole
/// read. Under every policy but `cached` (whose adapters are uploaded whole): waiting for the
/// layers from the file is never slower than waiting for the loader's queue and whole read
/// first (a property of [`crate::perf::LayerLanding`], the copy path `auto` models), and CPU
/// assist, where `auto` chooses it, computes from the same file.
pub(super) fn serves_from_file(policy: ColdStartPolicy) -> bool {
    policy != ColdStartPolicy::Cached
}

/// The requests running beside request `id`: how many, and the fewest output tokens one of
/// them has left (what `auto` spreads an assist's stretch over; `usize::MAX` with none).
fn beside(running: &[SeqState], id: SeqId) -> (usize, usize) {
    running
        .iter()
        .filter(|r| r.id != id)
        .fold((0, usize::MAX), |(n, f), r| (n + 1, f.min(r.tokens_left())))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use thaw_runtime::residency::LinkModel;

    use super::super::layer_gate::{in_step, layer_stall, InFlight, MAX_STALL_SHARE};
    use super::*;
    use crate::perf::PerfModel;

    /// `auto` spreads an assist's stretch over the running requests beside the cold one (not
    /// itself), by the one with the fewest output tokens left.
    #[test]
    fn beside_counts_the_others_and_their_fewest_tokens_left() {
        let seq = |id: u64, prompt: usize, max: usize, generated: usize| SeqState {
            total_tokens: prompt + generated,
            computed: prompt + generated - 1,
            ..SeqState::new(SeqId(id), prompt, max)
        };
        let running = [seq(1, 16, 32, 30), seq(2, 128, 64, 0), seq(3, 8, 100, 10)];
        assert_eq!(running[0].tokens_left(), 2);
        assert_eq!(beside(&running, SeqId(2)), (2, 2));
        assert_eq!(beside(&running, SeqId(1)), (2, 64));
        assert_eq!(beside(&running, SeqId(9)), (3, 2));
        assert_eq!(beside(&running[1..2], SeqId(2)), (0, usize::MAX));
    }

    /// Every policy but `cached` reads a disk miss from its file layer by layer.
    #[test]
    fn every_policy_but_cached_serves_a_disk_miss_from_its_file() {
        for p in [
            ColdStartPolicy::OnDemand,
            ColdStartPolicy::CpuAssist,
            ColdStartPolicy::Auto,
        ] {
            assert!(serves_from_file(p), "{p:?}");
        }
        assert!(!serves_from_file(ColdStartPolicy::Cached));
    }

    const WAIT: ColdGate = ColdGate::Run {
        cap: None,
        unlanded: UnlandedLayers::Wait,
    };

    /// `cached` holds and `cpu-assist` assists without asking anything; `on-demand` asks only
    /// the layer gate; `auto` asks its cost model, and the layer gate only where the model
    /// chose the copy.
    #[test]
    fn each_policy_asks_only_what_it_needs() {
        let no_decision = || -> ColdDecision { panic!("asked the cost model") };
        let no_layer_gate = || -> Gate { panic!("asked the layer gate") };
        assert_eq!(
            policy_gate(ColdStartPolicy::Cached, no_decision, no_layer_gate),
            ColdGate::Hold
        );
        assert_eq!(
            policy_gate(ColdStartPolicy::CpuAssist, no_decision, no_layer_gate),
            ColdGate::Run {
                cap: None,
                unlanded: UnlandedLayers::Assist
            }
        );
        for (g, want) in [(Gate::Go, WAIT), (Gate::Hold, ColdGate::Hold)] {
            assert_eq!(
                policy_gate(ColdStartPolicy::OnDemand, no_decision, || g),
                want
            );
            let auto = policy_gate(ColdStartPolicy::Auto, || ColdDecision::Wait, || g);
            assert_eq!(auto, want);
        }
        let assist = ColdDecision::Assist { max_chunk: 48 };
        let got = policy_gate(ColdStartPolicy::Auto, || assist, no_layer_gate);
        assert_eq!(
            got,
            ColdGate::Run {
                cap: Some(48),
                unlanded: UnlandedLayers::Assist
            }
        );
        assert_eq!(got.gate(), Gate::Cap(48));
        assert_eq!(WAIT.gate(), Gate::Go);
        assert_eq!(ColdGate::Warm.gate(), Gate::Go);
    }

    /// On the H200 of issue 27 (§8: `auto` held a host-tier miss ~7 ms "link"), a host-tier
    /// adapter just queued on an idle link: where `auto` chooses the copy, it now starts the
    /// request at once waiting for its layers in the step, as `on-demand` does. Read from its
    /// mapped file at a page-cache rate, each layer's read and encode outlasts its compute: the
    /// step would wait far beyond the bound, so it holds (the disk miss waits for its copy).
    #[test]
    fn auto_starts_a_host_tier_miss_on_the_h200_and_holds_a_slow_file_read() {
        let p = PerfModel {
            file_read_bytes_per_s: 4e9,
            host_encode_bytes_per_s: 0.8e9,
            ..super::super::layer_gate::tests::h200()
        };
        let host = InFlight {
            layers: 32,
            landed: 0,
            bytes: 134_217_728,
            ahead: 0,
            from_file: false,
        };
        let auto = |a| {
            policy_gate(
                ColdStartPolicy::Auto,
                || ColdDecision::Wait,
                || in_step(&p, a, 129),
            )
        };
        assert_eq!(auto(host), WAIT);
        let disk = InFlight {
            from_file: true,
            ..host
        };
        assert_eq!(auto(disk), ColdGate::Hold);
    }

    fn decision() -> impl Strategy<Value = ColdDecision> {
        prop_oneof![
            Just(ColdDecision::Wait),
            (1usize..2048).prop_map(|max_chunk| ColdDecision::Assist { max_chunk }),
        ]
    }

    proptest! {
        /// `auto` runs a request waiting for its layers exactly where its cost model chose the
        /// copy and on-demand's stall bound holds (the in-step wait of the one layer-landing
        /// model within [`MAX_STALL_SHARE`] of the step), the same answer `on-demand` gives
        /// there; it holds where the model chose the copy and the bound fails; an assist is
        /// capped as decided, whatever the layer gate would say. From host memory or the
        /// adapter's mapped file alike.
        #[test]
        fn auto_waits_in_the_step_exactly_where_on_demands_bound_holds(
            d in decision(),
            layers in 1usize..48,
            landed_frac in 0.0f64..1.0,
            mb in 1u64..400,
            ahead_mb in 0u64..400,
            gbps in 0.05f64..200.0,
            from_file in any::<bool>(),
            read_gbps in 0.5f64..20.0,
            tokens in 1usize..512,
        ) {
            let p = PerfModel {
                link: LinkModel { gbps, latency_us: 8.0 },
                file_read_bytes_per_s: read_gbps * 1e9,
                host_encode_bytes_per_s: 4.0 * read_gbps * 1e9,
                ..super::super::layer_gate::tests::h200()
            };
            let landed = ((layers as f64 * landed_frac) as usize).min(layers - 1);
            let a = InFlight { layers, landed, bytes: mb << 20, ahead: ahead_mb << 20, from_file };
            let bound = layer_stall(&p, a, tokens)
                <= MAX_STALL_SHARE * p.layer_time(tokens) * layers as f64;
            let auto = policy_gate(ColdStartPolicy::Auto, || d, || in_step(&p, a, tokens));
            let on_demand =
                policy_gate(ColdStartPolicy::OnDemand, || ColdDecision::Wait, || in_step(&p, a, tokens));
            match d {
                ColdDecision::Wait => {
                    prop_assert_eq!(auto, if bound { WAIT } else { ColdGate::Hold });
                    prop_assert_eq!(auto, on_demand);
                }
                ColdDecision::Assist { max_chunk } => prop_assert_eq!(
                    auto,
                    ColdGate::Run { cap: Some(max_chunk), unlanded: UnlandedLayers::Assist }
                ),
            }
        }
    }
}
