//! The layer gate of a request whose adapter is still streaming in and whose policy waits for
//! the copy (`on-demand` always, `auto` where its cost model chooses the copy). Before this
//! such a request waited until every layer had landed and then until the next step: on an H200
//! a 134 MB adapter copies in ~2.5 ms, but its requests waited ~7–12 ms "link" (the decode
//! step running meanwhile) on top (issue 27). Now the request runs in the step as soon as
//! waiting for its layers in the forward ([`thaw_runtime::engine::UnlandedLayers::Wait`])
//! would lengthen the step by little: the copy delivers layers in order at the link's rate
//! while the forward computes them at the step's rate, so the step waits for the first layer
//! still in flight and then only where the link is slower than the forward.
use thaw_runtime::engine::UnlandedLayers;
use thaw_runtime::ids::AdapterId;

use crate::coldstart::ColdStartPolicy;
use crate::perf::{LayerLanding, PerfModel};
use crate::scheduler::Gate;

use super::ServeEngine;

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
/// never computes one on the CPU, so it waits for them (when [`on_demand`] lets a request run
/// before its adapter landed); every other policy assists (`cached` never runs such a
/// request). `auto` marks each adapter whose request it starts waiting for its layers
/// ([`super::gate::ColdGate`]); the step loop applies the marks.
pub(super) fn unlanded_layers(policy: ColdStartPolicy) -> UnlandedLayers {
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

/// [`in_step`] for adapter `id` (`landed` of `layers` on the device) as the engine has it now:
/// its bytes, what is queued on the link ahead of it, whether it is read from its file.
pub(super) fn on_demand(
    engine: &ServeEngine,
    perf: &PerfModel,
    id: AdapterId,
    (landed, layers): (usize, usize),
    tokens: usize,
) -> Gate {
    let Some(a) = engine.adapter_host(id) else {
        return Gate::Hold;
    };
    let bytes = a.size_bytes() as u64;
    let left = bytes / layers.max(1) as u64 * layers.saturating_sub(landed) as u64;
    // What is queued on the link counts this adapter's own layers still to land.
    let ahead = engine.backend().link_backlog().saturating_sub(left);
    let a = InFlight {
        layers,
        landed,
        bytes,
        ahead,
        from_file: engine.adapter_is_mapped(id),
    };
    in_step(perf, a, tokens)
}

#[cfg(test)]
pub(super) mod tests {
    use proptest::prelude::*;
    use thaw_runtime::residency::LinkModel;

    use super::*;

    /// The H200 of issue 27: 32 layers, a 128-token prefill at ~0.7 ms a layer, a 55 GB/s link.
    pub(in crate::engine_loop) fn h200() -> PerfModel {
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
}
