//! The cold-start gate of a request whose adapter has not fully landed, shared by the HTTP
//! server's step planner (`engine_loop::gate`) and the engine-level driver
//! ([`super::driver`]) so both decide alike: the policy's answer ([`policy_gate`]) and, where
//! the policy waits for the copy (`on-demand` always, `auto` where its cost model chooses the
//! copy), the layer gate ([`in_step`]). Before the layer gate such a request waited until every
//! layer had landed and then until the next step: on an H200 a 134 MB adapter copies in
//! ~2.5 ms, but its requests waited ~7–12 ms "link" (the decode step running meanwhile) on top
//! (issue 27). Now the request runs in the step as soon as waiting for its layers in the
//! forward ([`thaw_runtime::engine::UnlandedLayers::Wait`]) would lengthen the step by little:
//! the copy delivers layers in order at the link's rate while the forward computes them at the
//! step's rate, so the step waits for the first layer still in flight and then only where the
//! link is slower than the forward. What a planned step then does with the answers
//! ([`carry_out`]): the adapters to mark wait or assist, and the requests held.
use thaw_runtime::engine::UnlandedLayers;
use thaw_runtime::ids::{AdapterId, SeqId};

use super::cost::ColdDecision;
use super::policy::ColdStartPolicy;
use crate::perf::{LayerLanding, PerfModel};
use crate::scheduler::Gate;

/// Most a step may be lengthened by waiting for a cold request's layers, as a share of the
/// step's predicted time: what the requests beside it pay once so that it starts a step early.
pub const MAX_STALL_SHARE: f64 = 0.05;

/// An adapter's layers still to land, as the step that would wait for them sees them.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct InFlight {
    pub layers: usize,
    pub landed: usize,
    /// The adapter's bytes (its device image, all layers).
    pub bytes: u64,
    /// Bytes queued on the link ahead of its layers still to land.
    pub ahead: u64,
    /// Its layers are still read from its mapped file before their copy (a disk miss).
    pub from_file: bool,
}

/// Seconds a step that starts now, computing `tokens` rows per layer, waits in all for `a`'s
/// layers: the one layer-landing model ([`LayerLanding`], the one `auto` costs a copy with),
/// its layers landing behind `ahead` on the link (each read from the file first for a disk
/// miss), the forward reaching layer `k` after `k` layers of compute. Pure.
pub fn layer_stall(perf: &PerfModel, a: InFlight, tokens: usize) -> f64 {
    let rate = perf.link.gbps.max(1e-9) * 1e9;
    let per_layer = a.bytes as f64 / a.layers.max(1) as f64;
    let read_s = if a.from_file {
        per_layer / perf.file_read_rate() + perf.encode_time(per_layer as u64)
    } else {
        0.0
    };
    LayerLanding {
        layers: a.layers.saturating_sub(a.landed),
        first: a.landed,
        queue_s: 0.0,
        read_s,
        copy_s: per_layer / rate + perf.link.latency_us * 1e-6,
        link_busy_s: a.ahead as f64 / rate,
    }
    .wait_s(perf.layer_time(tokens))
}

/// What the engine's steps do by default with layers not landed under `policy`: `on-demand`
/// never computes one on the CPU, so it waits for them (when `on_demand` lets a request run
/// before its adapter landed); every other policy assists (`cached` never runs such a
/// request). `auto` marks each adapter whose request it starts waiting for its layers
/// ([`ColdGate`]); the step (the server's, the driver's) applies the marks ([`carry_out`]).
pub fn unlanded_layers(policy: ColdStartPolicy) -> UnlandedLayers {
    match policy {
        ColdStartPolicy::OnDemand => UnlandedLayers::Wait,
        _ => UnlandedLayers::Assist,
    }
}

/// Go when waiting for `a`'s layers costs a step of `tokens` rows at most [`MAX_STALL_SHARE`]
/// of its predicted time; hold otherwise (the request waits for the copy). Pure.
pub fn in_step(perf: &PerfModel, a: InFlight, tokens: usize) -> Gate {
    let step = perf.layer_time(tokens) * a.layers as f64;
    if layer_stall(perf, a, tokens) <= MAX_STALL_SHARE * step {
        Gate::Go
    } else {
        Gate::Hold
    }
}

impl InFlight {
    /// Adapter of `bytes` with `landed` of `layers` on the device, `backlog` bytes queued on
    /// the link (its own layers still to land among them), read from its file where
    /// `from_file`: what a step starting now would wait for.
    pub fn of(bytes: u64, (landed, layers): (usize, usize), backlog: u64, from_file: bool) -> Self {
        let left = bytes / layers.max(1) as u64 * layers.saturating_sub(landed) as u64;
        InFlight {
            layers,
            landed,
            bytes,
            // What is queued on the link counts this adapter's own layers still to land.
            ahead: backlog.saturating_sub(left),
            from_file,
        }
    }
}

/// A prefilling request's cold-start gate and, when it runs before its adapter has landed,
/// what its step does with that adapter's layers not landed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ColdGate {
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
    pub fn gate(self) -> Gate {
        match self {
            ColdGate::Warm | ColdGate::Run { cap: None, .. } => Gate::Go,
            ColdGate::Hold => Gate::Hold,
            ColdGate::Run { cap: Some(c), .. } => Gate::Cap(c),
        }
    }
}

/// The gate of a request whose adapter has not fully landed, by policy: `decide` is `auto`'s
/// cost-model decision, `in_step` the layer gate ([`in_step`]: Go when waiting for its layers
/// in the step lengthens the step by at most [`MAX_STALL_SHARE`]); each is asked only where
/// the policy needs it.
/// - `cached` holds: its adapters are copied whole (on a GPU through the same asynchronous
///   pipeline as a streamed one, so a freshly registered one has not landed yet) and it never
///   computes a delta on the CPU.
/// - `on-demand` never computes a layer on the CPU: it runs waiting for the layers in the step
///   where the layer gate lets it, and holds otherwise.
/// - `cpu-assist` runs, its adapter's layers not landed computed on the CPU.
/// - `auto` runs assisted, capped, where its cost model chooses CPU assist; where it chooses
///   to wait for the copy, it waits as `on-demand` does: in the step when the layer gate lets
///   it, instead of until every layer landed and then for the next step.
pub fn policy_gate(
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

/// One answer of the gate for request `SeqId` whose adapter had not landed.
pub type Answer = (SeqId, AdapterId, ColdGate);

/// What a planned step does with the gate's answers (one per request, the last the planner
/// planned by): the adapters to mark, in the order to mark them (an adapter marked twice keeps
/// its last mark), and the requests held. A request counts only where the plan agrees with its
/// answer (it runs where the gate let it run, it is absent where held). Where two requests of
/// one adapter disagree, waiting wins: the waiting one's step then costs no more than the layer
/// gate allowed, and the assisted one's rows compute the same on the device. Pure.
pub fn carry_out(
    answers: &[Answer],
    planned: impl Fn(SeqId) -> bool,
) -> (Vec<(SeqId, AdapterId, UnlandedLayers)>, Vec<SeqId>) {
    let mut marks: Vec<(SeqId, AdapterId, UnlandedLayers)> = Vec::new();
    let mut held = Vec::new();
    for &(seq, adapter, g) in answers {
        match (g, planned(seq)) {
            (ColdGate::Run { unlanded, .. }, true) => marks.push((seq, adapter, unlanded)),
            (ColdGate::Hold, false) => held.push(seq),
            _ => {}
        }
    }
    // Assist first, so that a wait for the same adapter is its last mark.
    marks.sort_by_key(|&(.., u)| u == UnlandedLayers::Wait);
    (marks, held)
}

#[cfg(test)]
pub(crate) mod tests {
    use proptest::prelude::*;
    use thaw_runtime::residency::LinkModel;

    use super::*;

    /// The H200 of issue 27: 32 layers, a 128-token prefill at ~0.7 ms a layer, a 55 GB/s link.
    pub(crate) fn h200() -> PerfModel {
        PerfModel {
            num_layers: 32,
            layer_base_s: 0.36e-3,
            layer_per_token_s: 2.7e-6,
            link: LinkModel {
                gbps: 54.5,
                latency_us: 8.4,
            },
            ..Default::default()
        }
    }

    fn adapter(landed: usize, ahead: u64) -> InFlight {
        InFlight {
            layers: 32,
            landed,
            bytes: 134_217_728,
            ahead,
            from_file: false,
        }
    }

    /// On the H200 a host-tier adapter just queued costs a prefill step about one layer's
    /// copy (~85 µs of a ~23 ms step): the request goes now. Behind a second such adapter on
    /// the link the step would wait that whole copy too (~2.5 ms, over the bound): it holds.
    /// Over a link 1000× slower
    /// (the CPU backend's emulated one in the smoke runs) the step would wait ~2.5 s: hold.
    #[test]
    fn a_fast_link_lets_the_request_run_a_slow_one_holds_it() {
        let p = h200();
        let s = layer_stall(&p, adapter(0, 0), 129);
        assert!((80e-6..100e-6).contains(&s), "stall {s}");
        let step = p.layer_time(129) * 32.0;
        assert!(s <= MAX_STALL_SHARE * step);
        let behind = layer_stall(&p, adapter(0, 134_217_728), 129);
        assert!(
            behind > s + 2e-3 && behind > MAX_STALL_SHARE * step,
            "{behind}"
        );
        let slow = PerfModel {
            link: LinkModel {
                gbps: 0.0545,
                latency_us: 8.4,
            },
            ..h200()
        };
        let s = layer_stall(&slow, adapter(0, 0), 129);
        assert!(s > 2.0 && s > MAX_STALL_SHARE * step, "{s}");
        assert_eq!(layer_stall(&p, adapter(32, 0), 129), 0.0, "all landed");
    }

    proptest! {
        /// The stall is what a simulation of the two streams gives: layers landing one per
        /// transfer after the queue ahead, the forward reaching each layer after computing
        /// the ones before it and waiting where a layer has not landed. It never grows with
        /// more layers already landed, and is zero once all are.
        #[test]
        fn the_stall_matches_a_layer_by_layer_simulation(
            layers in 1usize..48,
            landed_frac in 0.0f64..1.0,
            mb in 1u64..400,
            ahead_mb in 0u64..400,
            gbps in 0.05f64..100.0,
            tokens in 1usize..512,
        ) {
            let p = PerfModel {
                link: LinkModel { gbps, latency_us: 8.0 },
                ..h200()
            };
            let landed = ((layers as f64 * landed_frac) as usize).min(layers);
            let a = InFlight {
                layers,
                landed,
                bytes: mb << 20,
                ahead: ahead_mb << 20,
                from_file: false,
            };
            let rate = gbps * 1e9;
            let each = a.bytes as f64 / layers as f64 / rate + 8e-6;
            let f = p.layer_time(tokens);
            // Simulate: t is when the forward reaches layer k (after waiting for it).
            let mut t = 0.0f64;
            for k in 0..layers {
                if k >= landed {
                    let lands = a.ahead as f64 / rate + (k - landed + 1) as f64 * each;
                    t = t.max(lands);
                }
                t += f;
            }
            let stall = t - layers as f64 * f;
            let got = layer_stall(&p, a, tokens);
            prop_assert!((got - stall).abs() <= 1e-9 + 1e-9 * stall.abs(), "{} vs {}", got, stall);
            if landed < layers {
                let more = InFlight { landed: landed + 1, ..a };
                prop_assert!(layer_stall(&p, more, tokens) <= got + 1e-12);
            } else {
                prop_assert_eq!(got, 0.0);
            }
        }
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
            ..h200()
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
                ..h200()
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

    fn run(u: UnlandedLayers) -> ColdGate {
        ColdGate::Run {
            cap: None,
            unlanded: u,
        }
    }

    fn answer() -> impl Strategy<Value = Answer> {
        let gate = prop_oneof![
            Just(ColdGate::Hold),
            Just(run(UnlandedLayers::Wait)),
            Just(run(UnlandedLayers::Assist)),
            (1usize..64).prop_map(|c| ColdGate::Run {
                cap: Some(c),
                unlanded: UnlandedLayers::Assist
            }),
        ];
        (0u64..12, 0u32..4, gate).prop_map(|(s, a, g)| (SeqId(s), AdapterId(a), g))
    }

    proptest! {
        /// Every planned request that runs is marked as its answer says, and only those; every
        /// held request left out of the plan is counted held, and only those; an adapter's last
        /// mark is a wait exactly when some planned request of it waits.
        #[test]
        fn marks_follow_the_answers_and_waiting_wins(
            answers in proptest::collection::vec(answer(), 0..16),
            planned in proptest::collection::vec(any::<bool>(), 12),
        ) {
            // One answer per request, as the log keeps.
            let mut one: Vec<Answer> = Vec::new();
            for a in answers {
                if !one.iter().any(|b| b.0 == a.0) {
                    one.push(a);
                }
            }
            let is_planned = |s: SeqId| planned[s.0 as usize];
            let (marks, held) = carry_out(&one, is_planned);
            for &(s, a, g) in &one {
                let marked = marks.iter().find(|m| m.0 == s);
                match g {
                    ColdGate::Run { unlanded, .. } if is_planned(s) => {
                        prop_assert_eq!(marked, Some(&(s, a, unlanded)));
                    }
                    _ => prop_assert!(marked.is_none()),
                }
                prop_assert_eq!(held.contains(&s), g == ColdGate::Hold && !is_planned(s));
            }
            for a in (0..4).map(AdapterId) {
                let last = marks.iter().rev().find(|m| m.1 == a).map(|m| m.2);
                let waits = one.iter().any(|&(s, b, g)| {
                    b == a && is_planned(s) && g == run(UnlandedLayers::Wait)
                });
                if waits {
                    prop_assert_eq!(last, Some(UnlandedLayers::Wait));
                } else {
                    prop_assert_ne!(last, Some(UnlandedLayers::Wait));
                }
            }
        }
    }
}
