//! The upload pipeline's decisions, as a pure state machine: which adapter image gets arena
//! space, which layer the loader threads encode next, which layer crosses the link next, and
//! when arena space comes back. The pipeline's threads only do what it says (copy bytes, issue
//! a copy, wait for an event), so its invariants are property-tested here without threads.
//!
//! The arena is the host tier's memory, not a staging buffer: an adapter's encoded device
//! *image* (one arena range) outlives the upload that wrote it, and a later upload of the same
//! image (the adapter evicted from the device and wanted again) queues only its copies. An
//! image is also written ahead of any upload when its adapter enters the host tier
//! ([`UploadPlan::stage`]), so a host-tier miss pays only the device copy. An image is freed
//! when its adapter leaves the host tier ([`UploadPlan::release`]), or dropped, least recently
//! used first, when a new image needs its space and nobody uses it.
//!
//! * the arena is never over-committed (space is reserved for a whole image before its first
//!   layer is encoded);
//! * a layer of an image is encoded once, however often the image is uploaded; a layer is
//!   copied once per upload, after it was encoded; layers land in order;
//! * one layer crosses the link at a time, the next chosen at each layer boundary: demand loads
//!   (a request computes with the adapter now) before prefetches before staging, each class
//!   first come first served, a prefetch in flight yielding at its next layer boundary (see
//!   [`crate::residency::LoadPriority`]);
//! * an image is freed exactly once, when no upload uses it, no loader thread writes it and no
//!   copy reads it: an upload evicted mid-copy gives its image back (kept if complete, freed
//!   if not), and a released image goes when its last user does.
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use super::arena::ArenaAlloc;
use crate::residency::LoadPriority;

/// An upload's id, unique for the life of a plan.
pub type JobId = u64;

/// An adapter image's id (one adapter in one layout), unique for the life of a plan: a key
/// once freed is never submitted again.
pub type ImageKey = u64;

/// A layer to encode: its bytes go to `arena` (absolute offsets in the arena); `image` is the
/// same range within the adapter's device image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodeTask {
    pub key: ImageKey,
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

/// One adapter image in the arena (or waiting for space).
#[derive(Debug)]
struct Image {
    /// Each layer's bytes within the image (ordered, disjoint; may be empty).
    layers: Vec<Range<usize>>,
    total: usize,
    arena: Option<Range<usize>>,
    /// Layers `0..staged` are encoded (the prefix the link may take).
    staged: usize,
    /// Layers `0..handed` were handed to loader threads: several loader threads encode
    /// layers of one image at once, so one adapter's encode is not one thread's memcpy.
    handed: usize,
    /// Layers at or past `staged` already encoded (they join the prefix in order).
    ahead: BTreeSet<usize>,
    /// Layers loader threads are encoding now.
    encoding: usize,
    /// Uploads using it (live, or evicted with a layer still on the link).
    users: usize,
    /// Written ahead of any upload (its adapter entered the host tier): the order among
    /// staged images, until it is complete.
    stage: Option<u64>,
    /// Its adapter left the host tier: freed once nobody uses it.
    released: bool,
    /// Last submit or stage, for least-recently-used drops.
    last_use: u64,
}

impl Image {
    fn complete(&self) -> bool {
        self.staged == self.layers.len()
    }

    /// A loader thread is done with `layer` (encoded it, or failed to): it was encoding it.
    fn finish_encoding(&mut self, layer: usize) {
        assert!(
            self.encoding > 0
                && layer >= self.staged
                && layer < self.handed
                && !self.ahead.contains(&layer),
            "layer {layer} was not being encoded"
        );
        self.encoding -= 1;
    }

    /// Nobody holds it: no upload, no loader thread.
    fn idle(&self) -> bool {
        self.users == 0 && self.encoding == 0
    }

    /// It may be dropped to make room: idle, holding space, and either complete or (for an
    /// upload's sake, `for_upload`) only staged.
    fn droppable(&self, for_upload: bool) -> bool {
        self.idle() && self.arena.is_some() && (self.stage.is_none() || for_upload)
    }
}

#[derive(Debug)]
struct Job {
    image: ImageKey,
    class: LoadPriority,
    /// Order within its class (FIFO; a promotion takes a fresh number).
    seq: u64,
    /// Layers `0..landed` are on the device.
    landed: usize,
    evicted: bool,
}

impl Job {
    fn key(&self) -> (u8, u64) {
        (u8::from(self.class == LoadPriority::Prefetch), self.seq)
    }
}

/// Arena space, images, queued uploads and the layer on the link.
#[derive(Debug)]
pub struct UploadPlan {
    arena: ArenaAlloc,
    images: BTreeMap<ImageKey, Image>,
    jobs: BTreeMap<JobId, Job>,
    next_seq: u64,
    /// The layer crossing the link now.
    in_flight: Option<(JobId, usize)>,
    /// Images freed since [`UploadPlan::take_freed`] was last called, with their space.
    freed: Vec<(ImageKey, Option<Range<usize>>)>,
}

impl UploadPlan {
    /// A plan over an arena of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self {
            arena: ArenaAlloc::new(capacity),
            images: BTreeMap::new(),
            jobs: BTreeMap::new(),
            next_seq: 0,
            in_flight: None,
            freed: Vec::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.arena.capacity()
    }

    /// Arena bytes reserved now (images in use and kept).
    pub fn arena_used(&self) -> usize {
        self.arena.used()
    }

    /// Arena bytes of complete images no upload uses now: the host tier's encoded adapters.
    pub fn retained_bytes(&self) -> usize {
        self.images
            .values()
            .filter(|i| i.complete() && i.idle())
            .filter_map(|i| i.arena.as_ref().map(Range::len))
            .sum()
    }

    fn tick(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn check_layers(&self, layers: &[Range<usize>], total: usize) -> Result<(), PlanError> {
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
        Ok(())
    }

    /// The image `key` (an existing one must have these layers), made if it is new.
    fn image(
        &mut self,
        key: ImageKey,
        layers: Vec<Range<usize>>,
        total: usize,
    ) -> Result<&mut Image, PlanError> {
        self.check_layers(&layers, total)?;
        let now = self.tick();
        let img = self.images.entry(key).or_insert_with(|| Image {
            layers: layers.clone(),
            total,
            arena: None,
            staged: 0,
            handed: 0,
            ahead: BTreeSet::new(),
            encoding: 0,
            users: 0,
            stage: None,
            released: false,
            last_use: now,
        });
        if img.layers != layers || img.total != total {
            return Err(PlanError::BadLayers);
        }
        assert!(!img.released, "image {key} used after it was released");
        img.last_use = now;
        Ok(img)
    }

    /// Queues upload `id` of image `key`, whose device image is `total` bytes with layer `l` at
    /// `layers[l]`. Returns whether the image was already complete in the arena (the upload
    /// encodes nothing: only its copies are queued).
    pub fn submit(
        &mut self,
        id: JobId,
        key: ImageKey,
        layers: Vec<Range<usize>>,
        total: usize,
        class: LoadPriority,
    ) -> Result<bool, PlanError> {
        let img = self.image(key, layers, total)?;
        img.users += 1;
        let reused = img.complete() && img.arena.is_some();
        let seq = self.tick();
        let prev = self.jobs.insert(
            id,
            Job {
                image: key,
                class,
                seq,
                landed: 0,
                evicted: false,
            },
        );
        assert!(prev.is_none(), "upload {id} submitted twice");
        Ok(reused)
    }

    /// Asks for image `key` to be encoded ahead of any upload (its adapter entered the host
    /// tier), behind every upload. Returns whether that queued work (false: it is already
    /// there or on its way).
    pub fn stage(
        &mut self,
        key: ImageKey,
        layers: Vec<Range<usize>>,
        total: usize,
    ) -> Result<bool, PlanError> {
        let now = self.next_seq + 1;
        let img = self.image(key, layers, total)?;
        if img.complete() || img.stage.is_some() {
            return Ok(false);
        }
        // Also while an upload writes it: an upload evicted half-way leaves it to staging.
        img.stage = Some(now);
        Ok(true)
    }

    /// Image `key`'s adapter left the host tier: its space is freed now if nobody uses it, else
    /// when the last user goes. A no-op for an unknown (already freed) key.
    pub fn release(&mut self, key: ImageKey) {
        if let Some(img) = self.images.get_mut(&key) {
            img.released = true;
            img.stage = None;
            self.reap_image(key);
        }
    }

    /// Images freed since the last call (each once), with the space they gave back.
    pub fn take_freed(&mut self) -> Vec<(ImageKey, Option<Range<usize>>)> {
        std::mem::take(&mut self.freed)
    }

    /// Whether image `key` is known (complete or on its way).
    pub fn has_image(&self, key: ImageKey) -> bool {
        self.images.contains_key(&key)
    }

    /// Makes a queued prefetch a demand load, behind the demand loads queued before; false if
    /// `id` is not a live prefetch.
    pub fn promote(&mut self, id: JobId) -> bool {
        let seq = self.next_seq + 1;
        match self.jobs.get_mut(&id) {
            Some(j) if !j.evicted && j.class == LoadPriority::Prefetch => {
                self.next_seq = seq;
                j.class = LoadPriority::Demand;
                j.seq = seq;
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

    /// Images in the order their layers are encoded: those of live uploads in service order,
    /// then staged ones in the order they were asked for.
    fn encode_order(&self) -> Vec<ImageKey> {
        let mut keys: Vec<ImageKey> = self.order().iter().map(|id| self.jobs[id].image).collect();
        let mut staged: Vec<(u64, ImageKey)> = self
            .images
            .iter()
            .filter_map(|(&k, i)| i.stage.map(|s| (s, k)))
            .collect();
        staged.sort_unstable();
        keys.extend(staged.into_iter().map(|(_, k)| k));
        keys
    }

    /// Space for image `key`: free space, or space of images nobody uses, least recently used
    /// first, dropped only if that makes enough room.
    fn make_room(&mut self, key: ImageKey, for_upload: bool) -> Option<Range<usize>> {
        let len = self.images[&key]
            .total
            .max(1)
            .next_multiple_of(super::arena::ARENA_ALIGN);
        if let Some(r) = self.arena.alloc(len) {
            return Some(r);
        }
        let mut victims: Vec<(u64, ImageKey, usize)> = self
            .images
            .iter()
            .filter(|(&k, i)| k != key && i.droppable(for_upload))
            .map(|(&k, i)| (i.last_use, k, i.arena.as_ref().map_or(0, Range::len)))
            .collect();
        let spare: usize = victims.iter().map(|v| v.2).sum();
        if self.arena.capacity() - self.arena.used() + spare < len {
            return None;
        }
        victims.sort_unstable();
        for (_, victim, _) in victims {
            self.free_image(victim);
            if let Some(r) = self.arena.alloc(len) {
                return Some(r);
            }
        }
        None
    }

    /// The next layer a loader thread encodes: the next layer not yet handed out of the first
    /// image in `encode_order` that has one, given arena space for the whole image first
    /// (an image that does not fit now waits; later ones that fit go ahead). Layers are handed
    /// out in order; loader threads may finish them out of order.
    pub fn next_encode(&mut self) -> Option<EncodeTask> {
        for key in self.encode_order() {
            // A staged image may have been dropped for an earlier one's space.
            let Some(img) = self.images.get(&key) else {
                continue;
            };
            if img.handed == img.layers.len() {
                continue;
            }
            if img.arena.is_none() {
                let for_upload = img.users > 0;
                let space = self.make_room(key, for_upload);
                self.images.get_mut(&key).expect("listed").arena = space;
            }
            let img = self.images.get_mut(&key).expect("listed");
            let Some(space) = &img.arena else { continue };
            let layer = img.handed;
            img.handed += 1;
            img.encoding += 1;
            let image = img.layers[layer].clone();
            return Some(EncodeTask {
                key,
                layer,
                arena: space.start + image.start..space.start + image.end,
                image,
            });
        }
        None
    }

    /// A loader thread finished encoding `layer` of image `key`.
    pub fn encoded(&mut self, key: ImageKey, layer: usize) {
        let img = self.images.get_mut(&key).expect("encoded an unknown image");
        img.finish_encoding(layer);
        img.ahead.insert(layer);
        while img.ahead.remove(&img.staged) {
            img.staged += 1;
        }
        if img.complete() {
            img.stage = None;
        }
        self.reap_image(key);
    }

    /// A loader thread could not encode `layer` of image `key`: its source is unreadable (a
    /// non-finite weight, a file truncated or changed under its mapping). The image is broken:
    /// no more of its layers are handed out or copied, every live upload of it is evicted
    /// (returned, so the caller fails their landings), it is never reused (a later upload of
    /// the adapter is a new image), and its space is freed once, when no loader thread writes
    /// it and no copy reads it. Layers already landed stay landed: each was read and checked
    /// whole before its copy was queued.
    pub fn encode_failed(&mut self, key: ImageKey, layer: usize) -> Vec<JobId> {
        let img = self.images.get_mut(&key).expect("failed an unknown image");
        img.finish_encoding(layer);
        img.handed = img.layers.len();
        img.stage = None;
        img.released = true;
        let jobs: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.image == key && !j.evicted)
            .map(|(&id, _)| id)
            .collect();
        for &id in &jobs {
            self.evict(id);
        }
        // Freed already if the last upload's eviction left it idle.
        if self.images.contains_key(&key) {
            self.reap_image(key);
        }
        jobs
    }

    /// The next layer to put on the link, if it is free: the first upload in service order
    /// whose next layer is encoded.
    pub fn next_copy(&mut self) -> Option<CopyTask> {
        if self.in_flight.is_some() {
            return None;
        }
        for id in self.order() {
            let j = &self.jobs[&id];
            let img = &self.images[&j.image];
            if j.landed < img.staged {
                let space = img.arena.as_ref().expect("staged layers have space");
                let image = img.layers[j.landed].clone();
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

    /// The layer on the link landed (its event completed); true if that was the upload's last
    /// layer (the upload is gone from the plan; its image stays).
    pub fn landed(&mut self, id: JobId, layer: usize) -> bool {
        assert_eq!(
            self.in_flight.take(),
            Some((id, layer)),
            "a layer landed that was not on the link"
        );
        let j = self.jobs.get_mut(&id).expect("in flight");
        j.landed += 1;
        let done = !j.evicted && j.landed == self.images[&j.image].layers.len();
        if done {
            j.evicted = true; // nothing left to do: reaped like an evicted job
        }
        self.reap_job(id);
        done
    }

    /// Drops upload `id` from the queues (its device slot is gone). Its image stays if it is
    /// complete and not released; space a loader thread writes or a copy reads is freed when
    /// that finishes.
    pub fn evict(&mut self, id: JobId) {
        if let Some(j) = self.jobs.get_mut(&id) {
            j.evicted = true;
            self.reap_job(id);
        }
    }

    /// Removes an evicted (or finished) upload whose layer is not on the link.
    fn reap_job(&mut self, id: JobId) {
        let j = &self.jobs[&id];
        if !j.evicted || self.in_flight.is_some_and(|(f, _)| f == id) {
            return;
        }
        let j = self.jobs.remove(&id).expect("present");
        let img = self.images.get_mut(&j.image).expect("a job's image");
        img.users -= 1;
        self.reap_image(j.image);
    }

    /// Frees image `key` if it is idle and released, or idle, incomplete and not staged (a
    /// half-written image nobody will finish).
    fn reap_image(&mut self, key: ImageKey) {
        let img = &self.images[&key];
        let abandoned = !img.complete() && img.stage.is_none();
        if img.idle() && (img.released || abandoned) {
            self.free_image(key);
        }
    }

    /// Frees image `key`'s space; the only place images go.
    fn free_image(&mut self, key: ImageKey) {
        let img = self.images.remove(&key).expect("present");
        debug_assert!(img.idle(), "image {key} freed while in use");
        if let Some(r) = &img.arena {
            self.arena.free(r.clone());
        }
        self.freed.push((key, img.arena));
    }

    fn remaining_bytes(&self, j: &Job) -> u64 {
        self.images[&j.image].layers[j.landed..]
            .iter()
            .map(|r| r.len() as u64)
            .sum()
    }

    /// Whether the plan still tracks upload `id` (live, or evicted with a layer still on the
    /// link).
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
            .map(|j| self.remaining_bytes(j))
            .sum()
    }

    /// Bytes a demand load queued now would wait behind: the demand loads not landed, and the
    /// layer of a prefetch on the link (prefetches yield at each layer).
    pub fn demand_backlog(&self) -> u64 {
        let demand: u64 = self
            .jobs
            .values()
            .filter(|j| !j.evicted && j.class == LoadPriority::Demand)
            .map(|j| self.remaining_bytes(j))
            .sum();
        let layer = match self.in_flight {
            Some((id, l)) => {
                let j = &self.jobs[&id];
                if j.class == LoadPriority::Prefetch && !j.evicted {
                    self.images[&j.image].layers[l].len() as u64
                } else {
                    0
                }
            }
            None => 0,
        };
        demand + layer
    }

    /// No upload left, nothing on the link, nothing being encoded or waiting to be staged
    /// (complete images may stay).
    pub fn is_idle(&self) -> bool {
        self.jobs.is_empty()
            && self.in_flight.is_none()
            && self
                .images
                .values()
                .all(|i| i.encoding == 0 && i.stage.is_none())
    }

    #[cfg(test)]
    pub(super) fn arena(&self) -> &ArenaAlloc {
        &self.arena
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
