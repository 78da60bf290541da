use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

/// One action on the pipeline: submit an upload of `layers` layers of `bytes` each, promote
/// or evict the `k`-th live upload, let a loader thread start or finish encoding a layer,
/// start a copy, or land the copy in flight.
#[derive(Clone, Debug)]
enum Op {
    Submit {
        layers: usize,
        bytes: usize,
        demand: bool,
    },
    Promote(usize),
    Evict(usize),
    StartEncode,
    FinishEncode(usize),
    Copy,
    Land,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..5, 0usize..1500, any::<bool>()).prop_map(|(layers, bytes, demand)| Op::Submit {
            layers,
            bytes,
            demand
        }),
        (0usize..6).prop_map(Op::Promote),
        (0usize..6).prop_map(Op::Evict),
        Just(Op::StartEncode),
        (0usize..3).prop_map(Op::FinishEncode),
        Just(Op::Copy),
        Just(Op::Land),
        Just(Op::Land),
    ]
}

/// What the test saw happen, checked against the plan's promises.
#[derive(Default)]
struct Seen {
    layers: BTreeMap<JobId, usize>,
    /// Encodes started, and finished.
    encoded: BTreeSet<(JobId, usize)>,
    staged: BTreeSet<(JobId, usize)>,
    copied: BTreeSet<(JobId, usize)>,
    landed: BTreeMap<JobId, usize>,
    /// Where each job's arena space starts (from its first encode task), and how often it
    /// was freed.
    space: BTreeMap<JobId, Range<usize>>,
    frees: BTreeMap<JobId, usize>,
    evicted: BTreeSet<JobId>,
    done: BTreeSet<JobId>,
    /// Encodes in progress (loader threads): job, layer.
    encoding: Vec<(JobId, usize)>,
    in_flight: Option<CopyTask>,
    classes: BTreeMap<JobId, LoadPriority>,
}

impl Seen {
    fn freed(&mut self, id: JobId, r: Option<Range<usize>>) -> Result<(), TestCaseError> {
        if let Some(r) = r {
            let start = self.space.get(&id).map(|s| s.start);
            prop_assert_eq!(Some(r.start), start, "freed another job's space");
            *self.frees.entry(id).or_default() += 1;
            prop_assert_eq!(self.frees[&id], 1, "job {} freed twice", id);
            prop_assert!(
                self.evicted.contains(&id) || self.done.contains(&id),
                "job {} freed while live",
                id
            );
        }
        Ok(())
    }
}

fn live(p: &UploadPlan, seen: &Seen) -> Vec<JobId> {
    seen.layers
        .keys()
        .copied()
        .filter(|id| p.contains(*id))
        .collect()
}

fn step(p: &mut UploadPlan, s: &mut Seen, o: Op, next_id: &mut JobId) -> Result<(), TestCaseError> {
    match o {
        Op::Submit {
            layers,
            bytes,
            demand,
        } => {
            let id = *next_id;
            *next_id += 1;
            // Layers laid out with gaps, as an aligned device image has.
            let ranges: Vec<Range<usize>> = (0..layers)
                .map(|l| l * (bytes + 64)..l * (bytes + 64) + bytes)
                .collect();
            let total = layers * (bytes + 64);
            let class = if demand {
                LoadPriority::Demand
            } else {
                LoadPriority::Prefetch
            };
            match p.submit(id, ranges, total, class) {
                Ok(()) => {
                    s.layers.insert(id, layers);
                    s.classes.insert(id, class);
                }
                Err(PlanError::TooLarge { .. }) => prop_assert!(total > p.capacity() / 2),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
        Op::Promote(k) => {
            if let Some(&id) = live(p, s).get(k) {
                let was = s.classes[&id];
                prop_assert_eq!(p.promote(id), was == LoadPriority::Prefetch);
                s.classes.insert(id, LoadPriority::Demand);
            }
        }
        Op::Evict(k) => {
            if let Some(&id) = live(p, s).get(k) {
                s.evicted.insert(id);
                let r = p.evict(id);
                s.freed(id, r)?;
                prop_assert!(!p.contains(id));
            }
        }
        Op::StartEncode => {
            if let Some(t) = p.next_encode() {
                prop_assert!(!s.evicted.contains(&t.job), "encoding an evicted job");
                prop_assert!(s.encoded.insert((t.job, t.layer)), "layer encoded twice");
                // Layers are handed out in order (loader threads may finish them in any).
                prop_assert!(t.layer == 0 || s.encoded.contains(&(t.job, t.layer - 1)));
                let space = s.space.entry(t.job).or_insert_with(|| {
                    t.arena.start - t.image.start..t.arena.start - t.image.start + 1
                });
                prop_assert_eq!(t.arena.start - t.image.start, space.start);
                s.encoding.push((t.job, t.layer));
            }
        }
        Op::FinishEncode(k) => {
            if !s.encoding.is_empty() {
                let (id, layer) = s.encoding.remove(k % s.encoding.len());
                s.staged.insert((id, layer));
                let r = p.encoded(id, layer);
                s.freed(id, r)?;
            }
        }
        Op::Copy => {
            let queued_demand = live(p, s).into_iter().any(|id| {
                s.classes[&id] == LoadPriority::Demand
                    && s.staged
                        .contains(&(id, s.landed.get(&id).copied().unwrap_or(0)))
            });
            match p.next_copy() {
                Some(t) => {
                    prop_assert!(s.in_flight.is_none(), "two layers on the link");
                    prop_assert!(
                        s.staged.contains(&(t.job, t.layer)),
                        "copied before encoded"
                    );
                    prop_assert!(s.copied.insert((t.job, t.layer)), "layer copied twice");
                    prop_assert!(!s.evicted.contains(&t.job));
                    prop_assert!(
                        s.classes[&t.job] == LoadPriority::Demand || !queued_demand,
                        "a prefetch took the link from a demand load"
                    );
                    s.in_flight = Some(t);
                }
                None => prop_assert!(s.in_flight.is_some() || !queued_demand),
            }
        }
        Op::Land => {
            if let Some(t) = s.in_flight.take() {
                let l = s.landed.entry(t.job).or_default();
                prop_assert_eq!(*l, t.layer, "layers land in order");
                *l += 1;
                let landed = *l;
                let r = p.landed(t.job, t.layer);
                let all = landed == s.layers[&t.job];
                prop_assert_eq!(r.done, all && !s.evicted.contains(&t.job));
                if r.done {
                    s.done.insert(t.job);
                }
                s.freed(t.job, r.freed)?;
            }
        }
    }
    // Never over-committed: reserved space within capacity, ranges disjoint.
    prop_assert!(p.arena_used() <= p.capacity());
    p.arena().check();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Under any interleaving of submissions, promotions, evictions, encodes, copies and
    /// landings: the arena is never over-committed, every layer is encoded once and copied
    /// once after it was encoded, layers land in order, demand loads never wait for a
    /// prefetch's layer, and an upload evicted mid-copy frees its arena space exactly once —
    /// and after draining, every upload that got space freed it once and the arena is empty.
    #[test]
    fn the_plan_keeps_its_promises(ops in proptest::collection::vec(op(), 0..150)) {
        let mut p = UploadPlan::new(8 * 1024);
        let mut s = Seen::default();
        let mut next_id = 0;
        for o in ops {
            step(&mut p, &mut s, o, &mut next_id)?;
        }
        // Drain: loader threads and the link run until nothing is left.
        for _ in 0..10_000 {
            if p.is_idle() && s.encoding.is_empty() {
                break;
            }
            step(&mut p, &mut s, Op::FinishEncode(0), &mut next_id)?;
            step(&mut p, &mut s, Op::Land, &mut next_id)?;
            step(&mut p, &mut s, Op::StartEncode, &mut next_id)?;
            step(&mut p, &mut s, Op::Copy, &mut next_id)?;
        }
        prop_assert!(p.is_idle(), "the pipeline did not drain");
        prop_assert_eq!(p.arena_used(), 0);
        for (id, layers) in &s.layers {
            if !s.evicted.contains(id) {
                prop_assert!(s.done.contains(id), "upload {} never finished", id);
                prop_assert_eq!(s.landed[id], *layers);
            }
            let got_space = s.space.contains_key(id);
            prop_assert_eq!(s.frees.get(id).copied().unwrap_or(0), usize::from(got_space));
        }
    }
}

/// A prefetch on the link yields at its next layer boundary to a demand load, then resumes;
/// eviction while a layer is on the link frees the space only when that layer lands.
#[test]
fn a_prefetch_yields_and_an_eviction_waits_for_the_copy() {
    let mut p = UploadPlan::new(4096);
    p.submit(1, vec![0..100, 100..200], 200, LoadPriority::Prefetch)
        .unwrap();
    let e = p.next_encode().unwrap();
    assert_eq!((e.job, e.layer, e.arena.clone()), (1, 0, 0..100));
    assert_eq!(p.encoded(1, 0), None);
    let c = p.next_copy().unwrap();
    assert_eq!((c.job, c.layer), (1, 0));
    assert_eq!(p.next_copy(), None, "one layer on the link");
    assert_eq!(p.demand_backlog(), 100);
    p.submit(
        2,
        std::iter::once(0..50).collect(),
        50,
        LoadPriority::Demand,
    )
    .unwrap();
    // The demand load is encoded first, into its own space.
    let e2 = p.next_encode().unwrap();
    assert_eq!((e2.job, e2.arena.start), (2, 256));
    p.encoded(2, 0);
    let e1 = p.next_encode().unwrap();
    assert_eq!((e1.job, e1.layer), (1, 1));
    p.encoded(1, 1);
    assert!(!p.landed(1, 0).done);
    let c = p.next_copy().unwrap();
    assert_eq!(c.job, 2, "the demand load goes at the layer boundary");
    assert_eq!(
        p.landed(2, 0),
        Landed {
            done: true,
            freed: Some(256..512)
        }
    );
    let c = p.next_copy().unwrap();
    assert_eq!((c.job, c.layer), (1, 1));
    assert_eq!(p.evict(1), None, "its last layer is still on the link");
    assert_eq!(p.queued_bytes(), 0);
    assert_eq!(
        p.landed(1, 1),
        Landed {
            done: false,
            freed: Some(0..256)
        }
    );
    assert!(p.is_idle());
    assert_eq!(
        p.submit(
            3,
            std::iter::once(0..5000).collect(),
            5000,
            LoadPriority::Demand
        ),
        Err(PlanError::TooLarge {
            bytes: 5000,
            capacity: 4096
        })
    );
}

/// Two loader threads encode layers 0 and 1 of one adapter at once; layer 1 finishing first
/// does not put it on the link ahead of layer 0, and the layers land in order.
#[test]
fn loaders_share_one_adapter_and_layers_still_land_in_order() {
    let mut p = UploadPlan::new(4096);
    p.submit(
        1,
        vec![0..100, 100..200, 200..300],
        300,
        LoadPriority::Demand,
    )
    .unwrap();
    let a = p.next_encode().unwrap();
    let b = p.next_encode().unwrap();
    assert_eq!(
        (a.layer, b.layer),
        (0, 1),
        "two layers of one adapter at once"
    );
    assert_eq!(p.encoded(1, 1), None);
    assert_eq!(p.next_copy(), None, "layer 1 waits for layer 0");
    assert_eq!(p.encoded(1, 0), None);
    let c = p.next_copy().unwrap();
    assert_eq!(c.layer, 0);
    assert!(!p.landed(1, 0).done);
    let c = p.next_copy().unwrap();
    assert_eq!(c.layer, 1);
    // Evicting while layer 2 is being encoded frees the space once, when that encode ends.
    let e = p.next_encode().unwrap();
    assert_eq!(e.layer, 2);
    assert!(!p.landed(1, 1).done);
    assert_eq!(p.evict(1), None, "layer 2 is still being written");
    assert_eq!(p.encoded(1, 2).map(|r| r.start), Some(0), "freed once, now");
    assert!(!p.known(1));
}
