//! The discrete-event loop: arrivals go through the router to an instance; each instance runs
//! one step at a time; adapter loads land. Time only moves from event to event. A request that
//! follows another (a conversation's next turn) arrives its think time after that one ends.
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::instance::{Instance, SimRequest};
use super::model::InstanceModel;
use super::router::{pick, RouteCtx, RouterKind};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Arrival(usize),
    StepEnd(usize),
    LoadLanded(usize),
}

#[derive(Clone, Copy, Debug)]
struct Event {
    at: f64,
    /// Insertion order: ties in time resolve first-in, first-out (deterministic runs).
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    /// Reversed: the heap pops the earliest event.
    fn cmp(&self, o: &Self) -> Ordering {
        o.at.total_cmp(&self.at).then(o.seq.cmp(&self.seq))
    }
}

/// What one simulated run measured.
#[derive(Clone, Debug, Default)]
pub struct SimResult {
    /// TTFT of every request that got a first token, seconds.
    pub ttft: Vec<f64>,
    /// The same, as (request id, TTFT).
    pub ttft_by_id: Vec<(usize, f64)>,
    pub finished: usize,
    pub loads: u64,
    /// From the first arrival to the last request's end.
    pub makespan: f64,
    /// From the first to the last arrival.
    pub arrival_span: f64,
    /// Prompt tokens looked up in the instances' prefix caches, and found there.
    pub prefix_queried: u64,
    pub prefix_hits: u64,
}

/// The cost model over simulated time: `(from, model)` points, the first from −∞. A planning
/// run has one; a replay has the server's dumped history, each snapshot standing for the
/// steps up to the time it was written.
#[derive(Clone, Copy, Debug)]
pub struct Timeline<'a> {
    points: &'a [(f64, InstanceModel)],
}

impl<'a> Timeline<'a> {
    /// `points` sorted by time, not empty.
    pub fn new(points: &'a [(f64, InstanceModel)]) -> Self {
        assert!(!points.is_empty(), "a timeline needs a cost model");
        debug_assert!(points.windows(2).all(|w| w[0].0 <= w[1].0));
        Self { points }
    }

    /// The model in force at `now`.
    pub fn at(&self, now: f64) -> &'a InstanceModel {
        let k = self.points.partition_point(|p| p.0 <= now);
        &self.points[k.saturating_sub(1)].1
    }
}

struct Sim<'a> {
    timeline: Timeline<'a>,
    insts: Vec<Instance>,
    heap: BinaryHeap<Event>,
    seq: u64,
}

impl Sim<'_> {
    fn push(&mut self, at: f64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Event {
            at,
            seq: self.seq,
            kind,
        });
    }

    fn try_step(&mut self, i: usize, now: f64) {
        if self.insts[i].busy {
            return;
        }
        let (dur, loads) = self.insts[i].plan_step(self.timeline.at(now), now);
        for t in loads {
            self.push(t, Kind::LoadLanded(i));
        }
        if let Some(d) = dur {
            self.insts[i].busy = true;
            self.push(now + d, Kind::StepEnd(i));
        }
    }
}

/// Runs `reqs` (sorted by arrival) on `n` instances behind `router`.
pub fn simulate(
    model: &InstanceModel,
    reqs: &[SimRequest],
    n: usize,
    router: RouterKind,
    ctx: &RouteCtx,
    seed: u64,
) -> SimResult {
    let one = [(f64::NEG_INFINITY, model.clone())];
    simulate_timeline(Timeline::new(&one), reqs, n, router, ctx, seed)
}

/// [`simulate`] with the cost model changing over time.
pub fn simulate_timeline(
    timeline: Timeline<'_>,
    reqs: &[SimRequest],
    n: usize,
    router: RouterKind,
    ctx: &RouteCtx,
    seed: u64,
) -> SimResult {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut sim = Sim {
        timeline,
        insts: (0..n.max(1))
            .map(|_| Instance::new(ctx.prefix_caching))
            .collect(),
        heap: BinaryHeap::with_capacity(reqs.len() + 2 * n),
        seq: 0,
    };
    // Follow-ups arrive when what they follow ends; the rest at their times.
    let mut arrive: Vec<f64> = reqs.iter().map(|r| r.at).collect();
    let mut next: Vec<Option<usize>> = vec![None; reqs.len()];
    let index: HashMap<usize, usize> = reqs.iter().enumerate().map(|(k, r)| (r.id, k)).collect();
    for (k, r) in reqs.iter().enumerate() {
        match r.after {
            Some((prev, _)) if prev < reqs.len() => next[prev] = Some(k),
            _ => sim.push(r.at, Kind::Arrival(k)),
        }
    }
    let mut last_arrival = f64::NEG_INFINITY;
    let mut out = SimResult {
        ttft: Vec::with_capacity(reqs.len()),
        ..Default::default()
    };
    let t0 = reqs
        .iter()
        .filter(|r| r.after.is_none())
        .map(|r| r.at)
        .min_by(f64::total_cmp)
        .unwrap_or(0.0);
    let mut now = t0;
    while let Some(ev) = sim.heap.pop() {
        now = ev.at;
        match ev.kind {
            Kind::Arrival(k) => {
                let r = SimRequest {
                    at: arrive[k],
                    ..reqs[k]
                };
                last_arrival = last_arrival.max(r.at);
                let model = sim.timeline.at(now);
                let i = pick(router, &r, &sim.insts, model, ctx, now, &mut rng);
                if let Some(t) = sim.insts[i].enqueue(r, model, now) {
                    sim.push(t, Kind::LoadLanded(i));
                }
                sim.try_step(i, now);
            }
            Kind::StepEnd(i) => {
                let o = sim.insts[i].finish_step(now, sim.timeline.at(now));
                out.ttft.extend(o.first_tokens.iter().map(|x| x.1));
                out.ttft_by_id.extend(o.first_tokens.iter().copied());
                out.finished += o.finished.len();
                for id in &o.finished {
                    if let Some(j) = index.get(id).and_then(|&k| next[k]) {
                        arrive[j] = now + reqs[j].after.map_or(0.0, |a| a.1);
                        sim.push(arrive[j], Kind::Arrival(j));
                    }
                }
                sim.try_step(i, now);
            }
            Kind::LoadLanded(i) => sim.try_step(i, now),
        }
    }
    out.loads = sim.insts.iter().map(|i| i.loads).sum();
    out.prefix_queried = sim.insts.iter().map(|i| i.cache.queried_tokens).sum();
    out.prefix_hits = sim.insts.iter().map(|i| i.cache.hit_tokens).sum();
    out.makespan = now - t0;
    out.arrival_span = if last_arrival.is_finite() {
        last_arrival - t0
    } else {
        0.0
    };
    debug_assert!(sim.insts.iter().all(Instance::is_idle));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::tests::snapshot;
    use crate::simulate::prefix::ChatTurn;

    fn reqs(n: usize, adapters: u32, gap: f64) -> Vec<SimRequest> {
        (0..n)
            .map(|i| SimRequest {
                id: i,
                at: i as f64 * gap,
                adapter: (i as u32 * 7919) % adapters,
                rank: 8 << (i % 3),
                prompt: 32 + (i * 13) % 200,
                output: 4 + (i * 7) % 40,
                chat: None,
                after: None,
            })
            .collect()
    }

    #[test]
    fn every_request_finishes_once_and_ttft_is_at_least_its_prefill() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let ctx = RouteCtx {
            avg_resp_len: 20.0,
            tpot_slo: 1.0,
            prefix_caching: false,
        };
        let rs = reqs(300, 50, 0.002);
        for router in RouterKind::ALL {
            let r = simulate(&m, &rs, 4, router, &ctx, 3);
            assert_eq!(r.finished, rs.len(), "{router:?}");
            assert_eq!(r.ttft.len(), rs.len(), "{router:?}");
            let min_prefill = m.base_step_time(32);
            assert!(
                r.ttft.iter().all(|t| *t >= min_prefill * 0.999),
                "{router:?}"
            );
            assert!(r.loads >= 50.min(rs.len()) as u64 / 4, "{router:?}");
            assert!(r.makespan >= r.arrival_span);
        }
    }

    /// A replayed history: the model written later rules later steps, so a slower second
    /// half stretches only the requests that run in it.
    #[test]
    fn the_timeline_switches_models_at_their_times() {
        let fast = InstanceModel::new(snapshot()).unwrap();
        let mut s = snapshot();
        s.perf.layer_per_token_s *= 10.0;
        let slow = InstanceModel::new(s).unwrap();
        let pts = [(f64::NEG_INFINITY, fast.clone()), (1.0, slow)];
        let t = Timeline::new(&pts);
        assert_eq!(t.at(0.5).perf.layer_per_token_s, 1e-5);
        assert_eq!(t.at(1.0).perf.layer_per_token_s, 1e-4);
        let ctx = RouteCtx {
            avg_resp_len: 20.0,
            tpot_slo: 1.0,
            prefix_caching: false,
        };
        let rs = reqs(40, 1, 0.05);
        let a = simulate(&fast, &rs, 1, RouterKind::Random, &ctx, 1);
        let b = simulate_timeline(t, &rs, 1, RouterKind::Random, &ctx, 1);
        let by_id = |r: &SimResult| {
            let mut v = r.ttft_by_id.clone();
            v.sort_by_key(|x| x.0);
            v
        };
        let (a, b) = (by_id(&a), by_id(&b));
        assert_eq!(a[0], b[0], "the first request runs before the switch");
        assert!(b[39].1 > a[39].1, "the last runs after it, slower");
    }

    /// Conversations of 4 turns over 3 adapters, each turn sent 0.2 s after the previous
    /// answer: every turn runs after the one it follows, and with prefix caching the later
    /// turns reuse the system prompt and earlier turns, so they start sooner.
    fn conversations(n: usize) -> Vec<SimRequest> {
        let mut v = Vec::new();
        for c in 0..n {
            for t in 0..4u32 {
                let k = v.len();
                let chat = ChatTurn {
                    conv: c as u32,
                    turn: t,
                    system: 300,
                    user: 24,
                    answer: 16,
                };
                v.push(SimRequest {
                    id: k,
                    at: c as f64 * 0.05,
                    adapter: c as u32 % 3,
                    rank: 8,
                    prompt: chat.prompt(),
                    output: 16,
                    chat: Some(chat),
                    after: (t > 0).then(|| (k - 1, 0.2)),
                });
            }
        }
        v
    }

    #[test]
    fn follow_up_turns_wait_for_their_answers_and_reuse_the_cache() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let rs = conversations(30);
        let mut ctx = RouteCtx {
            avg_resp_len: 16.0,
            tpot_slo: 1.0,
            prefix_caching: false,
        };
        let off = simulate(&m, &rs, 2, RouterKind::LeastQueue, &ctx, 5);
        ctx.prefix_caching = true;
        let on = simulate(&m, &rs, 2, RouterKind::PrefixAffinity, &ctx, 5);
        for r in [&off, &on] {
            assert_eq!(r.finished, rs.len());
            // The last turn of the last conversation came three answers and think times
            // after its start, so the arrivals span more than the starts do.
            assert!(
                r.arrival_span > 29.0 * 0.05 + 3.0 * 0.2,
                "{}",
                r.arrival_span
            );
        }
        assert_eq!((off.prefix_queried, off.prefix_hits), (0, 0));
        let queried: usize = rs.iter().map(|r| r.prompt).sum();
        assert_eq!(on.prefix_queried, queried as u64);
        // Turn 1 of each conversation can reuse at most its adapter's system prompt (288 of
        // 300 tokens in blocks of 16); turns 2-4 also their conversation's earlier turns.
        assert!(
            on.prefix_hits as f64 > 0.6 * queried as f64,
            "{} of {queried}",
            on.prefix_hits
        );
        let mean_later = |r: &SimResult| {
            let v: Vec<f64> = r
                .ttft_by_id
                .iter()
                .filter(|x| x.0 % 4 != 0)
                .map(|x| x.1)
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        assert!(
            mean_later(&on) < mean_later(&off),
            "{} vs {}",
            mean_later(&on),
            mean_later(&off)
        );
    }

    #[test]
    fn one_adapter_loads_once_per_instance_when_it_fits() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let ctx = RouteCtx {
            avg_resp_len: 20.0,
            tpot_slo: 1.0,
            prefix_caching: false,
        };
        let rs = reqs(100, 1, 0.01);
        let r = simulate(&m, &rs, 3, RouterKind::Random, &ctx, 9);
        assert!(r.loads <= 3, "{}", r.loads);
    }
}
