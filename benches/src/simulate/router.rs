//! Where a request goes: the routing rules compared, each a pure function of the instances'
//! state (what a router sees; the EPP's 50 ms scrape delay is not modelled).
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::instance::{Instance, SimRequest};
use super::model::{rank_of, InstanceModel};

/// A routing rule.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterKind {
    /// Uniformly at random.
    Random,
    /// Fewest outstanding requests (waiting + running); ties at random.
    LeastQueue,
    /// The Gateway API Inference Extension's EPP: lora-affinity-scorer + queue-scorer +
    /// kv-cache-utilization-scorer, weight 1 each, highest total wins (ties at random).
    EppLora,
    /// CaraServe §5's rank-aware cost (added prefill per response token + added decode time
    /// per token, a penalty past the decode SLO, times the requests there) with the adapter's
    /// load time added to the prefill where it is not resident.
    RankResidency,
}

impl RouterKind {
    pub const ALL: [RouterKind; 4] = [
        RouterKind::Random,
        RouterKind::LeastQueue,
        RouterKind::EppLora,
        RouterKind::RankResidency,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Random => "random",
            RouterKind::LeastQueue => "least-queue",
            RouterKind::EppLora => "epp-lora-affinity",
            RouterKind::RankResidency => "rank+residency",
        }
    }
}

/// What the rank-aware rule needs besides the instances.
#[derive(Clone, Copy, Debug)]
pub struct RouteCtx {
    /// Mean output tokens of the workload (CaraServe's avg_resp_len).
    pub avg_resp_len: f64,
    /// Decode step time above which an instance is penalised.
    pub tpot_slo: f64,
}

/// Penalty added to a cost that breaks the decode SLO (seconds; dominates any real cost).
const SLO_PENALTY: f64 = 1e6;

/// The EPP's lora-affinity-scorer: 1 if the adapter runs there, 0.8 if the instance has room
/// for another adapter, 0.6 if the adapter waits there, else 0.
pub fn lora_affinity(inst: &Instance, adapter: u32, max_loras: usize) -> f64 {
    let (running, waiting) = inst.adapter_requests(adapter);
    if running > 0 {
        1.0
    } else if inst.active_adapters() < max_loras {
        0.8
    } else if waiting > 0 {
        0.6
    } else {
        0.0
    }
}

/// CaraServe's cost of sending `req` to `inst`, with the adapter's load time where it is not
/// on the device yet.
pub fn rank_residency_cost(
    inst: &Instance,
    req: &SimRequest,
    model: &InstanceModel,
    ctx: &RouteCtx,
    now: f64,
) -> f64 {
    // The linear step model makes the added prefill the request's own tokens' share.
    let mut d_prefill = model.added_time(req.prompt, false, req.rank);
    d_prefill += match inst.device_eta(req.adapter, now) {
        Some(t) => t,
        None if inst.in_host(req.adapter) => model.link_time(req.rank),
        None => model.disk_time(req.rank) + model.link_time(req.rank),
    };
    let d_decode = model.added_time(1, true, req.rank);
    let mut after = inst.decode_shape();
    after.add(1, true, rank_of(req.rank));
    let decode_after = model.step_time(&after);
    let mut cost = d_prefill / ctx.avg_resp_len.max(1.0) + d_decode;
    if decode_after > ctx.tpot_slo {
        cost += SLO_PENALTY;
    }
    // CaraServe weighs by the requests there; +1 so an idle instance still compares by its
    // load time.
    cost * (inst.running_len() + inst.waiting_len() + 1) as f64
}

/// Index of the best-scoring instance (highest score), ties at random.
fn argmax(scores: impl Iterator<Item = f64>, rng: &mut ChaCha8Rng) -> usize {
    let (mut best, mut best_i, mut ties) = (f64::NEG_INFINITY, 0, 0u32);
    for (i, s) in scores.enumerate() {
        if s > best {
            (best, best_i, ties) = (s, i, 1);
        } else if s == best {
            // Reservoir sampling over the tied ones.
            ties += 1;
            if rng.random_range(0..ties) == 0 {
                best_i = i;
            }
        }
    }
    best_i
}

/// Picks the instance for `req`.
pub fn pick(
    kind: RouterKind,
    req: &SimRequest,
    insts: &[Instance],
    model: &InstanceModel,
    ctx: &RouteCtx,
    now: f64,
    rng: &mut ChaCha8Rng,
) -> usize {
    match kind {
        RouterKind::Random => rng.random_range(0..insts.len()),
        RouterKind::LeastQueue => argmax(
            insts
                .iter()
                .map(|i| -((i.waiting_len() + i.running_len()) as f64)),
            rng,
        ),
        RouterKind::EppLora => {
            let (lo, hi) = insts.iter().fold((usize::MAX, 0), |(lo, hi), i| {
                (lo.min(i.waiting_len()), hi.max(i.waiting_len()))
            });
            let max_loras = model.snap.limits.max_loras;
            argmax(
                insts.iter().map(|i| {
                    let queue = if hi == lo {
                        1.0
                    } else {
                        (hi - i.waiting_len()) as f64 / (hi - lo) as f64
                    };
                    let kv = 1.0 - i.kv_usage(model);
                    queue + kv + lora_affinity(i, req.adapter, max_loras)
                }),
                rng,
            )
        }
        RouterKind::RankResidency => argmax(
            insts
                .iter()
                .map(|i| -rank_residency_cost(i, req, model, ctx, now)),
            rng,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::tests::snapshot;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn req(adapter: u32, rank: u32) -> SimRequest {
        SimRequest {
            id: 0,
            at: 0.0,
            adapter,
            rank,
            prompt: 64,
            output: 8,
        }
    }

    #[test]
    fn affinity_prefers_the_instance_running_the_adapter() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let mut insts: Vec<Instance> = (0..3).map(|_| Instance::default()).collect();
        insts[2].enqueue(req(7, 8), &m, 0.0);
        let _ = insts[2].plan_step(&m, 0.0); // admits it: adapter 7 runs on instance 2
        assert_eq!(insts[2].adapter_requests(7), (1, 0));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let ctx = RouteCtx {
            avg_resp_len: 8.0,
            tpot_slo: 1.0,
        };
        assert_eq!(
            pick(
                RouterKind::EppLora,
                &req(7, 8),
                &insts,
                &m,
                &ctx,
                0.0,
                &mut rng
            ),
            2
        );
        // Least-queue avoids it; rank+residency weighs its resident adapter against its load.
        assert_ne!(
            pick(
                RouterKind::LeastQueue,
                &req(7, 8),
                &insts,
                &m,
                &ctx,
                0.0,
                &mut rng
            ),
            2
        );
        assert_eq!(lora_affinity(&insts[0], 7, 4), 0.8);
    }

    proptest! {
        /// Every rule picks a valid instance, and the rank+residency pick has the least cost.
        #[test]
        fn picks_are_valid_and_minimal(
            loads in proptest::collection::vec((0u32..6, 0usize..4), 1..12),
            adapter in 0u32..6,
            seed in 0u64..1000,
        ) {
            let m = InstanceModel::new(snapshot()).unwrap();
            let mut insts: Vec<Instance> = Vec::new();
            for (k, (a, n)) in loads.iter().enumerate() {
                let mut i = Instance::default();
                for j in 0..*n {
                    i.enqueue(SimRequest { id: k * 10 + j, ..req(*a, 8 << (j % 3)) }, &m, 0.0);
                }
                insts.push(i);
            }
            let ctx = RouteCtx { avg_resp_len: 8.0, tpot_slo: 1.0 };
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let r = req(adapter, 16);
            for kind in RouterKind::ALL {
                let i = pick(kind, &r, &insts, &m, &ctx, 0.0, &mut rng);
                prop_assert!(i < insts.len());
            }
            let best = pick(RouterKind::RankResidency, &r, &insts, &m, &ctx, 0.0, &mut rng);
            let c = rank_residency_cost(&insts[best], &r, &m, &ctx, 0.0);
            prop_assert!(insts.iter().all(|i| rank_residency_cost(i, &r, &m, &ctx, 0.0) >= c));
        }
    }
}
