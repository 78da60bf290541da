//! The upload pipeline's decisions, as a pure state machine: which adapter gets arena space,
//! which layer the loader threads encode next, which layer crosses the link next, and when
//! arena space comes back. The pipeline's threads only do what it says (copy bytes, issue a
//! copy, wait for an event), so its invariants are property-tested here without threads:
//!
//! * the arena is never over-committed (space is reserved for a whole adapter image before
//!   its first layer is encoded, and returned once its last layer landed);
//! * a layer is encoded once and copied once, after it was encoded; layers land in order;
//! * one layer crosses the link at a time, the next chosen at each layer boundary: demand loads
//!   (a request computes with the adapter now) before prefetches, each class first come first
//!   served, a prefetch in flight yielding at its next layer boundary (see
//!   [`crate::residency::LoadPriority`]);
//! * an adapter evicted mid-upload leaves the queues at once and frees its arena space exactly
//!   once, when no loader thread writes it and no copy reads it any more.
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use super::arena::ArenaAlloc;
use crate::residency::LoadPriority;

/// An upload's id, unique for the life of a plan.
pub type JobId = u64;

/// A layer to encode: its bytes go to `arena` (absolute offsets in the arena); `image` is the
/// same range within the adapter's device image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodeTask {
    pub job: JobId,
    pub layer: usize,
    pub arena: Range<usize>,
    pub image: Range<usize>,
}

/// A layer to copy: `arena` → `image` (offsets in the adapter's device allocation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyTask {
    pub job: JobId,
    pub layer: usize,
    pub arena: Range<usize>,
    pub image: Range<usize>,
}

/// Why a job cannot be uploaded at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "an adapter of {bytes} bytes cannot fit the {capacity}-byte host upload arena; \
         raise --max-cpu-lora-bytes"
    )]
    TooLarge { bytes: usize, capacity: usize },
    #[error("layer ranges must be ordered, non-overlapping and inside the image")]
    BadLayers,
}

#[derive(Debug)]
struct Job {
    /// Each layer's bytes within the image (ordered, disjoint; may be empty).
    layers: Vec<Range<usize>>,
    total: usize,
    class: LoadPriority,
    /// Order within its class (FIFO; a promotion takes a fresh number).
    seq: u64,
    arena: Option<Range<usize>>,
    /// Layers `0..staged` are encoded in the arena (the prefix the link may take).
    staged: usize,
    /// Layers `0..handed` were handed to loader threads: several loader threads encode
    /// layers of one adapter at once, so one adapter's encode is not one thread's memcpy.
    handed: usize,
    /// Layers at or past `staged` already encoded (they join the prefix in order).
    ahead: BTreeSet<usize>,
    /// Layers loader threads are encoding now.
    encoding: usize,
    /// Layers `0..landed` are on the device.
    landed: usize,
    evicted: bool,
}

impl Job {
    fn key(&self) -> (u8, u64) {
        (u8::from(self.class == LoadPriority::Prefetch), self.seq)
    }

    fn remaining_bytes(&self) -> u64 {
        self.layers[self.landed..]
            .iter()
            .map(|r| r.len() as u64)
            .sum()
    }
}

/// What a landed layer meant for its job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Landed {
    /// That was the job's last layer (the job is gone from the plan).
    pub done: bool,
    /// Arena space returned by this call.
    pub freed: Option<Range<usize>>,
}

/// Arena space, queued uploads and the layer on the link.
#[derive(Debug)]
pub struct UploadPlan {
    arena: ArenaAlloc,
    jobs: BTreeMap<JobId, Job>,
    next_seq: u64,
    /// The layer crossing the link now.
    in_flight: Option<(JobId, usize)>,
}

impl UploadPlan {
    /// A plan over an arena of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self {
            arena: ArenaAlloc::new(capacity),
            jobs: BTreeMap::new(),
            next_seq: 0,
            in_flight: None,
        }
    }

    pub fn capacity(&self) -> usize {
        self.arena.capacity()
    }

    /// Arena bytes reserved now.
    pub fn arena_used(&self) -> usize {
        self.arena.used()
    }

    /// Queues `id`, whose device image is `total` bytes with layer `l` at `layers[l]`.
    pub fn submit(
        &mut self,
        id: JobId,
        layers: Vec<Range<usize>>,
        total: usize,
        class: LoadPriority,
    ) -> Result<(), PlanError> {
        if total.max(1).next_multiple_of(super::arena::ARENA_ALIGN) > self.arena.capacity() {
            return Err(PlanError::TooLarge {
                bytes: total,
                capacity: self.arena.capacity(),
            });
        }
        let ordered = layers
            .windows(2)
            .all(|w| w[0].end <= w[1].start || w[1].is_empty());
        if !ordered || layers.iter().any(|r| r.start > r.end || r.end > total) {
            return Err(PlanError::BadLayers);
        }
        self.next_seq += 1;
        let prev = self.jobs.insert(
            id,
            Job {
                layers,
                total,
                class,
                seq: self.next_seq,
                arena: None,
                staged: 0,
                handed: 0,
                ahead: BTreeSet::new(),
                encoding: 0,
                landed: 0,
                evicted: false,
            },
        );
        assert!(prev.is_none(), "upload {id} submitted twice");
        Ok(())
    }

    /// Makes a queued prefetch a demand load, behind the demand loads queued before; false if
    /// `id` is not a live prefetch.
    pub fn promote(&mut self, id: JobId) -> bool {
        match self.jobs.get_mut(&id) {
            Some(j) if !j.evicted && j.class == LoadPriority::Prefetch => {
                self.next_seq += 1;
                j.class = LoadPriority::Demand;
                j.seq = self.next_seq;
                true
            }
            _ => false,
        }
    }

    /// Live jobs in the order they are served.
    fn order(&self) -> Vec<JobId> {
        let mut ids: Vec<(_, JobId)> = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.evicted)
            .map(|(&id, j)| (j.key(), id))
            .collect();
        ids.sort_unstable();
        ids.into_iter().map(|(_, id)| id).collect()
    }

    /// The next layer a loader thread encodes: the next layer not yet handed out of the first
    /// job in service order that has one, given arena space for its whole image first (a job
    /// that does not fit now waits; later ones that fit go ahead). Layers are handed out in
    /// order; loader threads may finish them out of order.
    pub fn next_encode(&mut self) -> Option<EncodeTask> {
        for id in self.order() {
            let j = self.jobs.get_mut(&id).expect("listed");
            if j.handed == j.layers.len() {
                continue;
            }
            if j.arena.is_none() {
                j.arena = self.arena.alloc(j.total);
            }
            let Some(space) = &j.arena else { continue };
            let layer = j.handed;
            j.handed += 1;
            j.encoding += 1;
            let image = j.layers[layer].clone();
            return Some(EncodeTask {
                job: id,
                layer,
                arena: space.start + image.start..space.start + image.end,
                image,
            });
        }
        None
    }

    /// A loader thread finished encoding `layer` of `id`; returns arena space freed (an
    /// adapter evicted meanwhile).
    pub fn encoded(&mut self, id: JobId, layer: usize) -> Option<Range<usize>> {
        let j = self.jobs.get_mut(&id).expect("encoded an unknown upload");
        assert!(
            j.encoding > 0 && layer >= j.staged && layer < j.handed && !j.ahead.contains(&layer),
            "layer {layer} was not being encoded"
        );
        j.encoding -= 1;
        j.ahead.insert(layer);
        while j.ahead.remove(&j.staged) {
            j.staged += 1;
        }
        self.reap(id)
    }

    /// The next layer to put on the link, if it is free: the first job in service order
    /// whose next layer is encoded.
    pub fn next_copy(&mut self) -> Option<CopyTask> {
        if self.in_flight.is_some() {
            return None;
        }
        for id in self.order() {
            let j = &self.jobs[&id];
            if j.landed < j.staged {
                let space = j.arena.as_ref().expect("staged layers have space");
                let image = j.layers[j.landed].clone();
                self.in_flight = Some((id, j.landed));
                return Some(CopyTask {
                    job: id,
                    layer: j.landed,
                    arena: space.start + image.start..space.start + image.end,
                    image,
                });
            }
        }
        None
    }

    /// The layer on the link landed (its event completed).
    pub fn landed(&mut self, id: JobId, layer: usize) -> Landed {
        assert_eq!(
            self.in_flight.take(),
            Some((id, layer)),
            "a layer landed that was not on the link"
        );
        let j = self.jobs.get_mut(&id).expect("in flight");
        j.landed += 1;
        let done = !j.evicted && j.landed == j.layers.len();
        if done {
            j.evicted = true; // nothing left to do: reaped like an evicted job
        }
        Landed {
            done,
            freed: self.reap(id),
        }
    }

    /// Drops `id` from the queues (its device slot is gone). Returns arena space freed now;
    /// space a loader thread writes or a copy reads is freed when that finishes.
    pub fn evict(&mut self, id: JobId) -> Option<Range<usize>> {
        let j = self.jobs.get_mut(&id)?;
        j.evicted = true;
        self.reap(id)
    }

    /// Removes an evicted (or finished) job nobody touches any more, freeing its space once.
    fn reap(&mut self, id: JobId) -> Option<Range<usize>> {
        let j = &self.jobs[&id];
        let busy = j.encoding > 0 || self.in_flight.is_some_and(|(f, _)| f == id);
        if !j.evicted || busy {
            return None;
        }
        let j = self.jobs.remove(&id).expect("present");
        let freed = j.arena;
        if let Some(r) = &freed {
            self.arena.free(r.clone());
        }
        freed
    }

    /// Whether the plan still tracks `id` (live, or evicted with a layer still being encoded or
    /// on the link).
    pub fn known(&self, id: JobId) -> bool {
        self.jobs.contains_key(&id)
    }

    /// Whether `id` is still queued or moving.
    pub fn contains(&self, id: JobId) -> bool {
        self.jobs.get(&id).is_some_and(|j| !j.evicted)
    }

    /// Bytes not landed yet over every live upload, prefetches included.
    pub fn queued_bytes(&self) -> u64 {
        self.jobs
            .values()
            .filter(|j| !j.evicted)
            .map(Job::remaining_bytes)
            .sum()
    }

    /// Bytes a demand load queued now would wait behind: the demand loads not landed, and the
    /// layer of a prefetch on the link (prefetches yield at each layer).
    pub fn demand_backlog(&self) -> u64 {
        let demand: u64 = self
            .jobs
            .values()
            .filter(|j| !j.evicted && j.class == LoadPriority::Demand)
            .map(Job::remaining_bytes)
            .sum();
        let layer = match self.in_flight {
            Some((id, l)) => {
                let j = &self.jobs[&id];
                if j.class == LoadPriority::Prefetch && !j.evicted {
                    j.layers[l].len() as u64
                } else {
                    0
                }
            }
            None => 0,
        };
        demand + layer
    }

    /// No job left, nothing on the link.
    pub fn is_idle(&self) -> bool {
        self.jobs.is_empty() && self.in_flight.is_none()
    }

    #[cfg(test)]
    pub(super) fn arena(&self) -> &ArenaAlloc {
        &self.arena
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
