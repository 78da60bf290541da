//! The discrete-event loop: arrivals go through the router to an instance; each instance runs
//! one step at a time; adapter loads land. Time only moves from event to event.
use std::cmp::Ordering;
use std::collections::BinaryHeap;

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
        insts: (0..n.max(1)).map(|_| Instance::default()).collect(),
        heap: BinaryHeap::with_capacity(reqs.len() + 2 * n),
        seq: 0,
    };
    for (k, r) in reqs.iter().enumerate() {
        sim.push(r.at, Kind::Arrival(k));
    }
    let mut out = SimResult {
        ttft: Vec::with_capacity(reqs.len()),
        ..Default::default()
    };
    let t0 = reqs.first().map_or(0.0, |r| r.at);
    let mut now = t0;
    while let Some(ev) = sim.heap.pop() {
        now = ev.at;
        match ev.kind {
            Kind::Arrival(k) => {
                let r = &reqs[k];
                let model = sim.timeline.at(now);
                let i = pick(router, r, &sim.insts, model, ctx, now, &mut rng);
                if let Some(t) = sim.insts[i].enqueue(*r, model, now) {
                    sim.push(t, Kind::LoadLanded(i));
                }
                sim.try_step(i, now);
            }
            Kind::StepEnd(i) => {
                let o = sim.insts[i].finish_step(now);
                out.ttft.extend(o.first_tokens.iter().map(|x| x.1));
                out.ttft_by_id.extend(o.first_tokens.iter().copied());
                out.finished += o.finished.len();
                sim.try_step(i, now);
            }
            Kind::LoadLanded(i) => sim.try_step(i, now),
        }
    }
    out.loads = sim.insts.iter().map(|i| i.loads).sum();
    out.makespan = now - t0;
    out.arrival_span = reqs.last().map_or(0.0, |r| r.at) - t0;
    debug_assert!(sim.insts.iter().all(Instance::is_idle));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::tests::snapshot;

    fn reqs(n: usize, adapters: u32, gap: f64) -> Vec<SimRequest> {
        (0..n)
            .map(|i| SimRequest {
                id: i,
                at: i as f64 * gap,
                adapter: (i as u32 * 7919) % adapters,
                rank: 8 << (i % 3),
                prompt: 32 + (i * 13) % 200,
                output: 4 + (i * 7) % 40,
            })
            .collect()
    }

    #[test]
    fn every_request_finishes_once_and_ttft_is_at_least_its_prefill() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let ctx = RouteCtx {
            avg_resp_len: 20.0,
            tpot_slo: 1.0,
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

    #[test]
    fn one_adapter_loads_once_per_instance_when_it_fits() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let ctx = RouteCtx {
            avg_resp_len: 20.0,
            tpot_slo: 1.0,
        };
        let rs = reqs(100, 1, 0.01);
        let r = simulate(&m, &rs, 3, RouterKind::Random, &ctx, 9);
        assert!(r.loads <= 3, "{}", r.loads);
    }
}
