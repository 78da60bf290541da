use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

/// Adapters the property test uploads, each with one image shape: (layers, bytes a layer).
const ADAPTERS: usize = 4;

/// One action: upload adapter `a` (its current image) as a demand load or a prefetch, stage
/// it (it entered the host tier), release it (it left the host tier: a later load is a new
/// image), promote or evict the `k`-th live upload, let a loader thread start or finish
/// encoding a layer, start a copy, or land the copy in flight.
#[derive(Clone, Debug)]
enum Op {
    Submit {
        a: usize,
        demand: bool,
    },
    Stage(usize),
    Release(usize),
    Promote(usize),
    Evict(usize),
    StartEncode,
    FinishEncode(usize),
    /// A loader thread finds the layer it reads unreadable (a NaN, a truncated file).
    FailEncode(usize),
    Copy,
    Land,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..ADAPTERS, any::<bool>()).prop_map(|(a, demand)| Op::Submit { a, demand }),
        (0..ADAPTERS).prop_map(Op::Stage),
        (0..ADAPTERS).prop_map(Op::Release),
        (0usize..6).prop_map(Op::Promote),
        (0usize..6).prop_map(Op::Evict),
        Just(Op::StartEncode),
        Just(Op::StartEncode),
        (0usize..3).prop_map(Op::FinishEncode),
        (0usize..3).prop_map(Op::FailEncode),
        Just(Op::Copy),
        Just(Op::Land),
        Just(Op::Land),
    ]
}

/// What the test saw happen, checked against the plan's promises.
struct Seen {
    shapes: Vec<(usize, usize)>,
    /// Each adapter's current image; a fresh key once its image is released or dropped.
    key_of: Vec<ImageKey>,
    next_key: ImageKey,
    /// Each image's adapter.
    owner: BTreeMap<ImageKey, usize>,
    released: BTreeSet<ImageKey>,
    /// Images a loader thread failed to encode.
    broken: BTreeSet<ImageKey>,
    /// Uploads: their image and layer count.
    jobs: BTreeMap<JobId, (ImageKey, usize)>,
    next_id: JobId,
    /// Image layers handed to loader threads (each at most once, ever), and finished.
    encoded: BTreeSet<(ImageKey, usize)>,
    staged: BTreeSet<(ImageKey, usize)>,
    copied: BTreeSet<(JobId, usize)>,
    landed: BTreeMap<JobId, usize>,
    /// Where each image's arena space starts (from its first encode task).
    space: BTreeMap<ImageKey, usize>,
    frees: BTreeMap<ImageKey, usize>,
    evicted: BTreeSet<JobId>,
    done: BTreeSet<JobId>,
    /// Encodes in progress (loader threads): image, layer.
    encoding: Vec<(ImageKey, usize)>,
    in_flight: Option<CopyTask>,
    classes: BTreeMap<JobId, LoadPriority>,
    /// Uploads that found their image complete, and the bytes they encoded anyway (none).
    reused: BTreeSet<JobId>,
}

impl Seen {
    fn new(shapes: Vec<(usize, usize)>) -> Self {
        Self {
            key_of: (0..shapes.len() as u64).collect(),
            next_key: shapes.len() as u64,
            owner: (0..shapes.len()).map(|a| (a as u64, a)).collect(),
            shapes,
            released: BTreeSet::new(),
            broken: BTreeSet::new(),
            jobs: BTreeMap::new(),
            next_id: 0,
            encoded: BTreeSet::new(),
            staged: BTreeSet::new(),
            copied: BTreeSet::new(),
            landed: BTreeMap::new(),
            space: BTreeMap::new(),
            frees: BTreeMap::new(),
            evicted: BTreeSet::new(),
            done: BTreeSet::new(),
            encoding: Vec::new(),
            in_flight: None,
            classes: BTreeMap::new(),
            reused: BTreeSet::new(),
        }
    }

    /// Adapter `a`'s image layers, laid out with gaps as an aligned device image has.
    fn layers(&self, a: usize) -> (Vec<Range<usize>>, usize) {
        let (layers, bytes) = self.shapes[a];
        let ranges = (0..layers)
            .map(|l| l * (bytes + 64)..l * (bytes + 64) + bytes)
            .collect();
        (ranges, layers * (bytes + 64))
    }

    fn complete(&self, key: ImageKey, layers: usize) -> bool {
        (0..layers).all(|l| self.staged.contains(&(key, l)))
    }

    fn image_layers(&self, key: ImageKey) -> usize {
        self.shapes[self.owner[&key]].0
    }

    /// A new image for adapter `a` (its last one released or dropped).
    fn fresh_key(&mut self, a: usize) {
        self.key_of[a] = self.next_key;
        self.owner.insert(self.next_key, a);
        self.next_key += 1;
    }

    /// Checks the images the plan freed during `o`: each once, none in use, a complete one
    /// kept by its adapter only when another image needed the space.
    fn check_freed(&mut self, p: &mut UploadPlan, o: &Op) -> Result<(), TestCaseError> {
        for (key, r) in p.take_freed() {
            let n = self.frees.entry(key).or_default();
            *n += 1;
            prop_assert_eq!(*n, 1, "image {} freed twice", key);
            prop_assert_eq!(r.map(|r| r.start), self.space.get(&key).copied());
            prop_assert!(
                !self.encoding.iter().any(|(k, _)| *k == key),
                "image {} freed while a loader writes it",
                key
            );
            let users: Vec<JobId> = self
                .jobs
                .iter()
                .filter(|(id, (k, _))| *k == key && p.known(**id))
                .map(|(id, _)| *id)
                .collect();
            prop_assert!(
                users.is_empty(),
                "image {} freed under uploads {:?}",
                key,
                users
            );
            let complete = self.complete(key, self.image_layers(key));
            if complete && !self.released.contains(&key) {
                prop_assert!(
                    matches!(o, Op::StartEncode),
                    "a kept image {} dropped outside a need for space",
                    key
                );
            }
            let a = self.owner[&key];
            if self.key_of[a] == key {
                self.fresh_key(a);
            }
        }
        Ok(())
    }
}

fn live(p: &UploadPlan, seen: &Seen) -> Vec<JobId> {
    seen.jobs
        .keys()
        .copied()
        .filter(|id| p.contains(*id))
        .collect()
}

fn step(p: &mut UploadPlan, s: &mut Seen, o: Op) -> Result<(), TestCaseError> {
    match o {
        Op::Submit { a, demand } => {
            let id = s.next_id;
            s.next_id += 1;
            let key = s.key_of[a];
            let (ranges, total) = s.layers(a);
            let class = if demand {
                LoadPriority::Demand
            } else {
                LoadPriority::Prefetch
            };
            match p.submit(id, key, ranges.clone(), total, class) {
                Ok(reused) => {
                    let was = s.complete(key, ranges.len()) && s.space.contains_key(&key);
                    prop_assert_eq!(reused, was, "reuse of image {}", key);
                    if reused {
                        s.reused.insert(id);
                    }
                    s.jobs.insert(id, (key, ranges.len()));
                    s.classes.insert(id, class);
                }
                Err(PlanError::TooLarge { .. }) => prop_assert!(total > p.capacity() / 2),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
        Op::Stage(a) => {
            let key = s.key_of[a];
            let (ranges, total) = s.layers(a);
            match p.stage(key, ranges.clone(), total) {
                Ok(queued) => prop_assert!(!queued || !s.complete(key, ranges.len())),
                Err(PlanError::TooLarge { .. }) => prop_assert!(total > p.capacity() / 2),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
        Op::Release(a) => {
            let key = s.key_of[a];
            s.released.insert(key);
            s.fresh_key(a);
            p.release(key);
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
                p.evict(id);
                prop_assert!(!p.contains(id));
            }
        }
        Op::StartEncode => {
            if let Some(t) = p.next_encode() {
                let for_upload = s
                    .jobs
                    .iter()
                    .any(|(id, (k, _))| *k == t.key && p.contains(*id));
                prop_assert!(
                    !s.released.contains(&t.key) || for_upload,
                    "encoding a released image {} nobody uploads",
                    t.key
                );
                prop_assert!(
                    s.encoded.insert((t.key, t.layer)),
                    "image layer encoded twice"
                );
                prop_assert!(
                    !s.broken.contains(&t.key),
                    "a broken image {} encoded",
                    t.key
                );
                // Layers are handed out in order (loader threads may finish them in any).
                prop_assert!(t.layer == 0 || s.encoded.contains(&(t.key, t.layer - 1)));
                let base = t.arena.start - t.image.start;
                prop_assert_eq!(*s.space.entry(t.key).or_insert(base), base);
                s.encoding.push((t.key, t.layer));
            }
        }
        Op::FinishEncode(k) => {
            if !s.encoding.is_empty() {
                let (key, layer) = s.encoding.remove(k % s.encoding.len());
                s.staged.insert((key, layer));
                p.encoded(key, layer);
            }
        }
        Op::FailEncode(k) => {
            if !s.encoding.is_empty() {
                let (key, layer) = s.encoding.remove(k % s.encoding.len());
                let mut users: Vec<JobId> = s
                    .jobs
                    .iter()
                    .filter(|(id, (k, _))| *k == key && p.contains(**id))
                    .map(|(id, _)| *id)
                    .collect();
                let mut failed = p.encode_failed(key, layer);
                users.sort();
                failed.sort();
                prop_assert_eq!(&failed, &users, "every live upload of image {} fails", key);
                for id in failed {
                    prop_assert!(!p.contains(id));
                    s.evicted.insert(id);
                }
                s.broken.insert(key);
                s.released.insert(key);
                let a = s.owner[&key];
                if s.key_of[a] == key {
                    s.fresh_key(a);
                }
            }
        }
        Op::Copy => {
            let next_staged = |id: &JobId| {
                let key = s.jobs[id].0;
                s.staged
                    .contains(&(key, s.landed.get(id).copied().unwrap_or(0)))
            };
            let queued_demand = live(p, s)
                .into_iter()
                .any(|id| s.classes[&id] == LoadPriority::Demand && next_staged(&id));
            match p.next_copy() {
                Some(t) => {
                    let key = s.jobs[&t.job].0;
                    prop_assert!(s.in_flight.is_none(), "two layers on the link");
                    prop_assert!(s.staged.contains(&(key, t.layer)), "copied before encoded");
                    prop_assert!(s.copied.insert((t.job, t.layer)), "layer copied twice");
                    prop_assert!(!s.evicted.contains(&t.job));
                    prop_assert!(!s.broken.contains(&key), "a broken image {} copied", key);
                    prop_assert_eq!(t.arena.start - t.image.start, s.space[&key]);
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
                let done = p.landed(t.job, t.layer);
                let all = landed == s.jobs[&t.job].1;
                prop_assert_eq!(done, all && !s.evicted.contains(&t.job));
                if done {
                    s.done.insert(t.job);
                }
            }
        }
    }
    s.check_freed(p, &o)?;
    // Never over-committed: reserved space within capacity, ranges disjoint.
    prop_assert!(p.arena_used() <= p.capacity());
    prop_assert!(p.retained_bytes() <= p.arena_used());
    p.arena().check();
    Ok(())
}

fn shapes() -> impl Strategy<Value = Vec<(usize, usize)>> {
    proptest::collection::vec((1usize..5, 0usize..1500), ADAPTERS)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Under any interleaving of uploads, staging, releases, promotions, evictions, encodes,
    /// copies and landings: the arena is never over-committed; a layer of an image is encoded
    /// once however often the image is uploaded (an upload of a complete image encodes
    /// nothing); every layer is copied once per upload after it was encoded and layers land
    /// in order; demand loads never wait for a prefetch's layer; an image is freed exactly once
    /// and never under an upload (evicted mid-copy or not), a loader or a copy; an image whose
    /// encode failed fails every live upload of it, is neither encoded nor copied again, and is
    /// freed once like any other — and after
    /// draining and releasing every adapter, every image that got space freed it once and the
    /// arena is empty.
    #[test]
    fn the_plan_keeps_its_promises(shapes in shapes(), ops in proptest::collection::vec(op(), 0..150)) {
        let mut p = UploadPlan::new(8 * 1024);
        let mut s = Seen::new(shapes);
        for o in ops {
            step(&mut p, &mut s, o)?;
        }
        // Drain: loader threads and the link run until nothing is left.
        for _ in 0..10_000 {
            if p.is_idle() && s.encoding.is_empty() {
                break;
            }
            for o in [Op::FinishEncode(0), Op::Land, Op::StartEncode, Op::Copy] {
                step(&mut p, &mut s, o)?;
            }
        }
        prop_assert!(p.is_idle(), "the pipeline did not drain");
        for (id, (_, layers)) in &s.jobs {
            if !s.evicted.contains(id) {
                prop_assert!(s.done.contains(id), "upload {} never finished", id);
                prop_assert_eq!(s.landed[id], *layers);
            }
        }
        for a in 0..ADAPTERS {
            step(&mut p, &mut s, Op::Release(a))?;
        }
        prop_assert_eq!(p.arena_used(), 0);
        for key in s.space.keys() {
            prop_assert_eq!(s.frees.get(key).copied().unwrap_or(0), 1, "image {}", key);
        }
    }
}

/// A prefetch on the link yields at its next layer boundary to a demand load, then resumes;
/// a finished upload keeps its image; a released image in use by an evicted upload whose layer
/// is on the link is freed only when that layer lands.
#[test]
fn a_prefetch_yields_and_an_eviction_waits_for_the_copy() {
    let mut p = UploadPlan::new(4096);
    let fresh = p
        .submit(1, 10, vec![0..100, 100..200], 200, LoadPriority::Prefetch)
        .unwrap();
    assert!(!fresh);
    let e = p.next_encode().unwrap();
    assert_eq!((e.key, e.layer, e.arena.clone()), (10, 0, 0..100));
    p.encoded(10, 0);
    let c = p.next_copy().unwrap();
    assert_eq!((c.job, c.layer), (1, 0));
    assert_eq!(p.next_copy(), None, "one layer on the link");
    assert_eq!(p.demand_backlog(), 100);
    p.submit(
        2,
        20,
        std::iter::once(0..50).collect(),
        50,
        LoadPriority::Demand,
    )
    .unwrap();
    // The demand load is encoded first, into its own space.
    let e2 = p.next_encode().unwrap();
    assert_eq!((e2.key, e2.arena.start), (20, 256));
    p.encoded(20, 0);
    let e1 = p.next_encode().unwrap();
    assert_eq!((e1.key, e1.layer), (10, 1));
    p.encoded(10, 1);
    assert!(!p.landed(1, 0));
    let c = p.next_copy().unwrap();
    assert_eq!(c.job, 2, "the demand load goes at the layer boundary");
    assert!(p.landed(2, 0));
    assert_eq!(p.take_freed(), vec![], "a finished upload keeps its image");
    assert_eq!(p.retained_bytes(), 256);
    let c = p.next_copy().unwrap();
    assert_eq!((c.job, c.layer), (1, 1));
    p.evict(1);
    p.release(10);
    assert_eq!(
        p.take_freed(),
        vec![],
        "its last layer is still on the link"
    );
    assert_eq!(p.queued_bytes(), 0);
    assert!(!p.landed(1, 1));
    assert_eq!(p.take_freed(), vec![(10, Some(0..256))]);
    p.release(20);
    p.release(20);
    assert_eq!(p.take_freed(), vec![(20, Some(256..512))], "freed once");
    assert!(p.is_idle());
    assert_eq!(p.arena_used(), 0);
    assert_eq!(
        p.submit(
            3,
            30,
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
/// does not put it on the link ahead of layer 0, and the layers land in order. An upload
/// evicted while its last layer is written leaves a complete image, kept; one evicted while its
/// image is half written frees the image once, when the write ends.
#[test]
fn loaders_share_one_adapter_and_layers_still_land_in_order() {
    let mut p = UploadPlan::new(4096);
    p.submit(
        1,
        5,
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
    p.encoded(5, 1);
    assert_eq!(p.next_copy(), None, "layer 1 waits for layer 0");
    p.encoded(5, 0);
    let c = p.next_copy().unwrap();
    assert_eq!(c.layer, 0);
    assert!(!p.landed(1, 0));
    let c = p.next_copy().unwrap();
    assert_eq!(c.layer, 1);
    let e = p.next_encode().unwrap();
    assert_eq!(e.layer, 2);
    assert!(!p.landed(1, 1));
    p.evict(1);
    p.encoded(5, 2);
    assert_eq!(p.take_freed(), vec![], "a complete image is kept");
    assert_eq!(p.retained_bytes(), 512);
    assert!(!p.known(1) && p.has_image(5));
    // Evicted while its image is half written: freed once, when the write ends.
    p.submit(2, 6, vec![0..100, 100..200], 200, LoadPriority::Demand)
        .unwrap();
    assert_eq!(p.next_encode().unwrap().key, 6);
    p.evict(2);
    assert_eq!(p.take_freed(), vec![], "layer 0 is still being written");
    p.encoded(6, 0);
    assert_eq!(p.take_freed(), vec![(6, Some(512..768))], "freed once, now");
    assert!(!p.known(2) && !p.has_image(6));
}

/// An image staged when its adapter entered the host tier is written behind uploads; a later
/// upload of it encodes nothing and only copies, also after an upload of it was evicted
/// mid-copy; images nobody uses are dropped, least recently used first, when a new image
/// needs their space.
#[test]
fn a_kept_image_is_copied_without_encoding_and_dropped_for_space() {
    let mut p = UploadPlan::new(4096);
    let layers = vec![0..100, 256..356];
    assert_eq!(p.stage(7, layers.clone(), 512), Ok(true));
    p.submit(
        1,
        8,
        std::iter::once(0..10).collect(),
        10,
        LoadPriority::Demand,
    )
    .unwrap();
    assert_eq!(
        p.next_encode().unwrap().key,
        8,
        "staging waits behind uploads"
    );
    p.encoded(8, 0);
    for (l, r) in layers.iter().enumerate() {
        let t = p.next_encode().unwrap();
        assert_eq!((t.key, t.layer, t.arena.start), (7, l, 256 + r.start));
        p.encoded(7, l);
    }
    assert_eq!(p.next_encode(), None);
    assert_eq!(p.stage(7, layers.clone(), 512), Ok(false), "already there");
    let c = p.next_copy().unwrap();
    assert_eq!(c.job, 1);
    assert!(p.landed(1, 0));
    // The adapter's upload reuses the image: copies only.
    assert_eq!(
        p.submit(2, 7, layers.clone(), 512, LoadPriority::Demand),
        Ok(true)
    );
    assert_eq!(p.next_encode(), None);
    for (l, r) in layers.iter().enumerate() {
        let c = p.next_copy().unwrap();
        assert_eq!((c.job, c.layer, c.arena.start), (2, l, 256 + r.start));
        assert_eq!(p.landed(2, l), l == 1);
    }
    // Evicted mid-copy: the image stays for the next upload.
    assert_eq!(
        p.submit(3, 7, layers.clone(), 512, LoadPriority::Demand),
        Ok(true)
    );
    let c = p.next_copy().unwrap();
    p.evict(3);
    assert!(!p.landed(c.job, 0));
    assert_eq!(p.take_freed(), vec![]);
    assert_eq!(p.retained_bytes(), 256 + 512);
    assert_eq!(
        p.submit(4, 7, layers.clone(), 512, LoadPriority::Demand),
        Ok(true)
    );
    p.evict(4);
    // A whole-arena image drops both, the least recently used (8) first.
    assert_eq!(
        p.stage(9, std::iter::once(0..4096).collect(), 4096),
        Ok(true)
    );
    let t = p.next_encode().unwrap();
    assert_eq!((t.key, t.arena), (9, 0..4096));
    assert_eq!(p.take_freed(), vec![(8, Some(0..256)), (7, Some(256..768))]);
}
