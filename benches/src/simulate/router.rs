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
    /// The instance caching the longest prefix of the request's prompt under its adapter
    /// (its cached blocks), ties to the fewest outstanding requests, then at random.
    PrefixAffinity,
    /// The EPP with the prefix-cache-scorer as `deploy/kubernetes/epp.yaml` configures it:
    /// epp-lora-affinity's three scorers (weight 1 each) plus weight [`EPP_PREFIX_WEIGHT`] ×
    /// the share of the prompt's blocks cached there. The real scorer tracks the blocks it
    /// routed (an LRU per pod); here it sees the instance's cache, its best case.
    EppPrefix,
}

/// The prefix-cache-scorer's weight in `deploy/kubernetes/epp.yaml`.
pub const EPP_PREFIX_WEIGHT: f64 = 2.0;

impl RouterKind {
    pub const ALL: [RouterKind; 6] = [
        RouterKind::Random,
        RouterKind::LeastQueue,
        RouterKind::EppLora,
        RouterKind::RankResidency,
        RouterKind::PrefixAffinity,
        RouterKind::EppPrefix,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Random => "random",
            RouterKind::LeastQueue => "least-queue",
            RouterKind::EppLora => "epp-lora-affinity",
            RouterKind::RankResidency => "rank+residency",
            RouterKind::PrefixAffinity => "prefix-affinity",
            RouterKind::EppPrefix => "epp+prefix-cache",
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
    /// Whether the instances keep prefix caches (issue 28).
    pub prefix_caching: bool,
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

/// The prefix-affinity rule's score: cached prompt blocks first, then fewer outstanding
/// requests (a queue never reaches 10⁶).
pub fn prefix_affinity_score(cached_blocks: usize, outstanding: usize) -> f64 {
    cached_blocks as f64 * 1e6 - outstanding as f64
}

/// The prefix-cache-scorer's score: matched blocks ÷ the prompt's full blocks (0 for a prompt
/// under one block), as the EPP computes it.
pub fn prefix_share(cached_blocks: usize, prompt: usize, block_size: usize) -> f64 {
    let total = prompt / block_size.max(1);
    if total == 0 {
        0.0
    } else {
        cached_blocks.min(total) as f64 / total as f64
    }
}

/// The EPP's queue-scorer + kv-cache-utilization-scorer + lora-affinity-scorer per instance.
fn epp_scores<'a>(
    insts: &'a [Instance],
    adapter: u32,
    model: &'a InstanceModel,
) -> impl Iterator<Item = f64> + 'a {
    let (lo, hi) = insts.iter().fold((usize::MAX, 0), |(lo, hi), i| {
        (lo.min(i.waiting_len()), hi.max(i.waiting_len()))
    });
    let max_loras = model.snap.limits.max_loras;
    insts.iter().map(move |i| {
        let queue = if hi == lo {
            1.0
        } else {
            (hi - i.waiting_len()) as f64 / (hi - lo) as f64
        };
        let kv = 1.0 - i.kv_usage(model);
        queue + kv + lora_affinity(i, adapter, max_loras)
    })
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
        RouterKind::EppLora => argmax(epp_scores(insts, req.adapter, model), rng),
        RouterKind::PrefixAffinity | RouterKind::EppPrefix => {
            // Every instance sees the same segments (caching is per run).
            let segs = insts[0].segments_of(req);
            let cached = insts
                .iter()
                .map(|i| i.prefix_hit(&segs, req.prompt, model).blocks);
            if kind == RouterKind::PrefixAffinity {
                let scores = cached
                    .zip(insts)
                    .map(|(c, i)| prefix_affinity_score(c, i.waiting_len() + i.running_len()));
                argmax(scores, rng)
            } else {
                let bs = model.snap.limits.block_size;
                let scores = epp_scores(insts, req.adapter, model)
                    .zip(cached)
                    .map(|(e, c)| e + EPP_PREFIX_WEIGHT * prefix_share(c, req.prompt, bs));
                argmax(scores, rng)
            }
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
    use crate::simulate::prefix::ChatTurn;
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
            chat: None,
            after: None,
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
            prefix_caching: false,
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

    /// Runs `r` alone on `inst` to its end (its prompt and answer then sit in the cache).
    fn serve(inst: &mut Instance, r: SimRequest, m: &InstanceModel) {
        let mut now = r.at;
        if let Some(t) = inst.enqueue(r, m, now) {
            now = t;
        }
        while let (Some(d), _) = inst.plan_step(m, now) {
            now += d;
            inst.finish_step(now, m);
        }
        assert!(inst.is_idle());
    }

    fn chat(adapter: u32, conv: u32, turn: u32) -> SimRequest {
        let c = ChatTurn {
            conv,
            turn,
            system: 200,
            user: 40,
            answer: 24,
        };
        SimRequest {
            prompt: c.prompt(),
            output: c.answer as usize,
            chat: Some(c),
            ..req(adapter, 8)
        }
    }

    #[test]
    fn prefix_affinity_follows_the_longest_chain_of_the_adapter() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let mut insts: Vec<Instance> = (0..4).map(|_| Instance::new(true)).collect();
        // Instance 1 served conversation 5's first turn under adapter 3; instance 2 another
        // conversation of adapter 3 (the system prompt only); instance 3 conversation 5's
        // first turn under adapter 4.
        serve(&mut insts[1], chat(3, 5, 0), &m);
        serve(&mut insts[2], chat(3, 6, 0), &m);
        serve(&mut insts[3], chat(4, 5, 0), &m);
        let ctx = RouteCtx {
            avg_resp_len: 24.0,
            tpot_slo: 1.0,
            prefix_caching: true,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let next = chat(3, 5, 1);
        let segs = insts[0].segments_of(&next);
        let blocks: Vec<usize> = insts
            .iter()
            .map(|i| i.prefix_hit(&segs, next.prompt, &m).blocks)
            .collect();
        // 200 + 40 + 24 = 264 tokens: 16 blocks; the system prompt alone: 12.
        assert_eq!(blocks, vec![0, 16, 12, 0]);
        for kind in [RouterKind::PrefixAffinity, RouterKind::EppPrefix] {
            assert_eq!(
                pick(kind, &next, &insts, &m, &ctx, 0.0, &mut rng),
                1,
                "{kind:?}"
            );
        }
        // A new conversation of adapter 3: instances 1 and 2 hold its system prompt; the
        // tie goes to the one with fewer outstanding requests.
        insts[1].enqueue(req(9, 8), &m, 0.0);
        let fresh = chat(3, 7, 0);
        for _ in 0..20 {
            let i = pick(
                RouterKind::PrefixAffinity,
                &fresh,
                &insts,
                &m,
                &ctx,
                0.0,
                &mut rng,
            );
            assert_eq!(i, 2);
        }
        assert_eq!(prefix_share(16, 264, 16), 1.0);
        assert_eq!(prefix_share(12, 304, 16), 12.0 / 19.0);
        assert_eq!(prefix_share(3, 10, 16), 0.0);
    }

    proptest! {
        /// The prefix-affinity pick holds the most cached blocks, and of those instances the
        /// fewest outstanding requests.
        #[test]
        fn prefix_affinity_is_lexicographic(
            state in proptest::collection::vec((0usize..40, 0usize..50), 1..16),
        ) {
            let scores: Vec<f64> = state.iter().map(|&(c, q)| prefix_affinity_score(c, q)).collect();
            let mut rng = ChaCha8Rng::seed_from_u64(0);
            let i = argmax(scores.into_iter(), &mut rng);
            let best = state.iter().map(|s| s.0).max().unwrap();
            prop_assert_eq!(state[i].0, best);
            let q = state.iter().filter(|s| s.0 == best).map(|s| s.1).min().unwrap();
            prop_assert_eq!(state[i].1, q);
        }

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
            let ctx = RouteCtx { avg_resp_len: 8.0, tpot_slo: 1.0, prefix_caching: false };
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
