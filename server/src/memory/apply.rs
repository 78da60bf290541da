//! Carrying an [`AdmitPlan`] out on an engine: evictions first (their pages are what the loads
//! use), then host → device loads, prefetches (behind every demand load on the copy link), and
//! disk reads for the loader.
use std::collections::HashSet;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::Engine;
use thaw_runtime::error::RuntimeError;
use thaw_runtime::ids::AdapterId;
use thaw_runtime::kv::PageError;

use super::admission::AdmitPlan;
use super::loader::{FetchJob, Loader};
use super::manager::MemoryManager;
use crate::coldstart::ColdStartPolicy;

/// How adapters go to the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Upload {
    /// Every layer at once (the `cached` cold-start policy): on the CPU backend resident at
    /// once, on a GPU through the same upload pipeline as a streamed adapter; its requests
    /// start once every layer has landed either way. A disk-tier stand-in goes layer by layer
    /// all the same ([`Upload::for_host`]).
    Whole,
    /// Layer by layer over the copy engine, served meanwhile as the cold-start policy says.
    Stream,
}

impl Upload {
    /// How `policy` uploads adapters: `cached` whole, every other policy layer by layer.
    pub fn of(policy: ColdStartPolicy) -> Upload {
        match policy {
            ColdStartPolicy::Cached => Upload::Whole,
            ColdStartPolicy::OnDemand | ColdStartPolicy::CpuAssist | ColdStartPolicy::Auto => {
                Upload::Stream
            }
        }
    }

    /// How `host` goes to the device under `self`. A disk-tier stand-in
    /// ([`LoraAdapter::is_stand_in`]: a disk miss served from its mapped file,
    /// [`crate::memory::mapped`]) goes layer by layer under every policy: the upload pipeline
    /// reads each layer from the file, checks it (file unchanged, weights finite) and queues
    /// its copy as soon as it is in the arena, so the read overlaps the copy. Uploaded whole,
    /// the CPU backend would make the unread, unchecked mapping resident at once. `cached`
    /// still waits for the whole adapter: its gate holds a request until every layer of its
    /// adapter has landed ([`crate::coldstart::policy_gate`]).
    pub fn for_host(self, host: &LoraAdapter) -> Upload {
        if host.is_stand_in() {
            Upload::Stream
        } else {
            self
        }
    }
}

/// `id` may have entered the host tier (registered with its weights, or read from disk): if the
/// tier kept it, its device image is written into the engine's upload arena now, off the engine
/// thread, so a later load of it only copies. The arena frees the image once the adapter's last
/// reference (the host tier's, the device copy's) is gone. The host tier counts the image's
/// bytes, with the heap copy's if the host copy is held in memory (not read in place), against
/// `--max-cpu-lora-bytes` (`wanted`: adapters of queued requests, kept over the bound).
pub fn stage_host<B: Backend>(
    mgr: &mut MemoryManager,
    engine: &mut Engine<B>,
    id: AdapterId,
    wanted: &HashSet<AdapterId>,
) {
    if let Some(h) = mgr.host_copy(id) {
        let image = engine.stage_adapter(&h);
        mgr.on_staged(id, image as u64, wanted);
    }
}

/// Applies `plan`; returns the adapters registered with the engine (to watch them land).
pub fn apply<B: Backend>(
    mgr: &mut MemoryManager,
    engine: &mut Engine<B>,
    plan: &AdmitPlan,
    kv_reserved: usize,
    upload: Upload,
    wanted: &HashSet<AdapterId>,
    loader: Option<&Loader>,
) -> Vec<AdapterId> {
    for &v in &plan.evict {
        match engine.unregister_adapter(v) {
            // The engine does not have it: its pages are free all the same.
            Ok(()) | Err(RuntimeError::UnknownAdapter(_)) => mgr.on_evicted(v, wanted),
            Err(e) => tracing::warn!("evicting adapter {v}: {e}"),
        }
    }
    let mut registered = Vec::new();
    let loads = plan.load.iter().map(|a| (*a, false));
    for (a, prefetch) in loads.chain(plan.prefetch.iter().map(|a| (*a, true))) {
        if engine.has_adapter(a) {
            continue;
        }
        let Some(host) = mgr.host_copy(a) else {
            continue;
        };
        if let Err(e) = mgr.on_registered(a, kv_reserved, prefetch) {
            tracing::debug!("adapter {a} does not fit yet: {e}");
            continue;
        }
        let upload = upload.for_host(&host);
        let r = match upload {
            // A prefetch yields the link to every demand load until its request runs, and
            // takes only pages nobody uses: it evicts nothing.
            Upload::Stream if prefetch => engine.prefetch_adapter(a, host),
            _ => {
                let mut victims = None;
                place_evicting(
                    &mut (&mut *mgr, &mut *engine),
                    |(_, engine)| match upload {
                        Upload::Whole => engine.register_adapter(a, host.clone()),
                        Upload::Stream => engine.register_adapter_streaming(a, host.clone()),
                    },
                    |(mgr, _)| {
                        let v = victims.get_or_insert_with(|| mgr.idle_resident(wanted));
                        (!v.is_empty()).then(|| v.remove(0))
                    },
                    |(mgr, engine), v| match engine.unregister_adapter(v) {
                        Ok(()) => {
                            tracing::info!(
                                "evicted adapter {v}: KV blocks in use split the free pages, \
                                 and adapter {a} needs a run of them"
                            );
                            mgr.on_evicted(v, wanted);
                            true
                        }
                        Err(_) => false,
                    },
                )
            }
        };
        match r {
            Ok(()) => registered.push(a),
            Err(e) => {
                tracing::warn!("registering adapter {a} with the engine: {e}");
                mgr.on_register_failed(a);
            }
        }
    }
    if let Some(loader) = loader {
        for &a in &plan.fetch {
            let Some(bytes) = mgr.bytes(a) else { continue };
            let root = mgr.root(a);
            if let Some(path) = mgr.start_fetch(a) {
                if !loader.fetch(FetchJob {
                    id: a,
                    path,
                    root,
                    bytes: Some(bytes),
                }) {
                    tracing::error!("the adapter loader thread has stopped");
                }
            }
        }
    }
    registered
}

/// Places an adapter with `place`; when it finds no run of consecutive free pages for the
/// image ([`RuntimeError::AdapterPages`]: on a GPU an adapter's image takes a run of KV pages,
/// and KV blocks in use can split the free pages so that none is long enough although they
/// are there in number), evicts the next adapter `victim` names with `evict` (false: it could
/// not be evicted, the next is tried) and places again, until it is placed, it fails for
/// another reason, or no victim is left (the last error). An evicted adapter's run is whole,
/// so one eviction places an adapter of its size. Without this the request waited, queued,
/// until running requests finished and freed their KV blocks (262 ms on an H200, issue 27).
pub fn place_evicting<C>(
    ctx: &mut C,
    mut place: impl FnMut(&mut C) -> Result<(), RuntimeError>,
    mut victim: impl FnMut(&mut C) -> Option<AdapterId>,
    mut evict: impl FnMut(&mut C, AdapterId) -> bool,
) -> Result<(), RuntimeError> {
    loop {
        let r = place(ctx);
        if !matches!(r, Err(RuntimeError::AdapterPages(PageError::NoRun { .. }))) {
            return r;
        }
        loop {
            let Some(v) = victim(ctx) else {
                return r;
            };
            if evict(ctx, v) {
                break;
            }
        }
    }
}

/// Which of the requests admission chose may run after [`apply`]: those without an adapter or
/// whose adapter the engine holds. A load the engine refused (no run of free pages while KV
/// blocks in use split them) leaves its requests waiting, planned again at the next step:
/// queued, never failed. `adapter_of` answers a waiting request's adapter.
pub fn runnable_after_apply(
    admit: &mut Vec<thaw_runtime::ids::SeqId>,
    adapter_of: impl Fn(thaw_runtime::ids::SeqId) -> Option<AdapterId>,
    registered: impl Fn(AdapterId) -> bool,
) {
    admit.retain(|&id| adapter_of(id).is_none_or(&registered));
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use thaw_runtime::ids::SeqId;
    use thaw_runtime::kv::{BlockAllocator, KvBlocks};

    use super::*;

    /// The one device budget as on the H200 run of issue 27, scaled down: adapters' images in
    /// runs of 8 pages from the top, KV blocks of two running requests growing a block at a
    /// time, in turn, below them. When one request finishes, its blocks are free but every
    /// other one, so a new adapter finds no run of 8 though 12 pages are free. Placing it
    /// evicts the least recently used idle adapter, whose run is whole, and places it there:
    /// one eviction, not a wait for the other request to finish.
    #[test]
    fn an_adapter_with_no_run_of_pages_evicts_one_idle_adapter_and_is_placed() {
        let (total, n) = (48, 8);
        let pool = BlockAllocator::new(total, 1);
        // Four adapters cached on the device (ids 1..=4, 1 used least recently).
        let mut leases: BTreeMap<u32, _> = (1..=4)
            .map(|id| (id, pool.assign_adapter(u64::from(id), n).unwrap()))
            .collect();
        let (mut a, mut b): (KvBlocks, KvBlocks) = (pool.empty(), pool.empty());
        for t in 1..=8 {
            pool.grow_to(&mut a, t).unwrap();
            pool.grow_to(&mut b, t).unwrap();
        }
        drop(a);
        let free = total - 4 * n - b.len();
        assert!(free >= n, "{free} pages free, enough in number");
        let owner = 99;
        let no_run = pool.assign_adapter(owner, n).map(drop).unwrap_err();
        assert!(
            matches!(no_run, RuntimeError::AdapterPages(PageError::NoRun { .. })),
            "the free pages are split: {no_run}"
        );
        let mut placed = None;
        let mut victims = vec![AdapterId(1), AdapterId(2), AdapterId(3), AdapterId(4)];
        let mut evicted = Vec::new();
        let r = place_evicting(
            &mut leases,
            |_| {
                placed = Some(pool.assign_adapter(owner, n)?);
                Ok(())
            },
            |_| (!victims.is_empty()).then(|| victims.remove(0)),
            |leases, v| {
                evicted.push(v);
                leases.remove(&v.0).is_some()
            },
        );
        r.unwrap();
        assert_eq!(
            evicted,
            vec![AdapterId(1)],
            "one eviction, the first victim"
        );
        let run = placed.expect("placed").run();
        assert_eq!(run.len(), n);
        assert_eq!(leases.len(), 3);
    }

    proptest! {
        /// `place_evicting` evicts only while the placement fails for want of a run: never
        /// before it, never after it succeeds, never for another error; a victim that cannot
        /// be evicted is passed over; with no victim left, the last error is the answer.
        #[test]
        fn evicts_only_while_no_run_is_found(
            fails in 0usize..6,
            other_error in any::<bool>(),
            stuck in prop::collection::vec(any::<bool>(), 0..8),
        ) {
            let no_run = || RuntimeError::AdapterPages(PageError::NoRun {
                need: 8, free: 8, owned: 0, total: 16,
            });
            // (placements tried, victims offered, evictions done)
            let mut ctx = (0usize, 0usize, 0usize);
            let victims = stuck.len();
            let r = place_evicting(
                &mut ctx,
                |c| {
                    c.0 += 1;
                    if c.0 <= fails {
                        Err(if other_error { RuntimeError::Backend("copy".into()) } else { no_run() })
                    } else {
                        Ok(())
                    }
                },
                |c| (c.1 < victims).then(|| { c.1 += 1; AdapterId(c.1 as u32) }),
                |c, v| {
                    let ok = !stuck[v.0 as usize - 1];
                    c.2 += usize::from(ok);
                    ok
                },
            );
            let (tries, offered, evictions) = ctx;
            if fails == 0 {
                prop_assert!(r.is_ok());
                prop_assert_eq!((tries, offered), (1, 0));
            } else if other_error {
                prop_assert!(matches!(r, Err(RuntimeError::Backend(_))));
                prop_assert_eq!((tries, offered), (1, 0));
            } else {
                let evictable = stuck.iter().filter(|s| !**s).count();
                // Every failed try but the last was followed by one eviction.
                prop_assert_eq!(tries, 1 + evictions);
                if evictable >= fails {
                    prop_assert!(r.is_ok());
                    prop_assert_eq!(evictions, fails);
                } else {
                    prop_assert!(matches!(r, Err(RuntimeError::AdapterPages(_))));
                    prop_assert_eq!(evictions, evictable);
                    prop_assert_eq!(offered, victims);
                }
            }
        }
    }

    proptest! {
        /// A request stays admitted exactly when it has no adapter or the engine holds its
        /// adapter; the order of the admitted ones is kept.
        #[test]
        fn refused_loads_leave_their_requests_waiting(
            reqs in prop::collection::vec(prop::option::of(0u32..6), 0..24),
            held in prop::collection::vec(any::<bool>(), 6),
        ) {
            let ids: Vec<SeqId> = (0..reqs.len() as u64).map(SeqId).collect();
            let adapter_of = |id: SeqId| reqs[id.0 as usize].map(AdapterId);
            let registered = |a: AdapterId| held[a.0 as usize];
            let mut admit = ids.clone();
            runnable_after_apply(&mut admit, adapter_of, registered);
            let want: Vec<SeqId> = ids
                .into_iter()
                .filter(|&id| adapter_of(id).is_none_or(registered))
                .collect();
            prop_assert_eq!(&admit, &want);
            for id in admit {
                if let Some(a) = adapter_of(id) {
                    prop_assert!(held[a.0 as usize], "request {:?} admitted with adapter {:?} not held", id, a);
                }
            }
        }
    }
}
