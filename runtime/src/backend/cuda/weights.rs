//! Weights on the device: matrices and norms in the backend's weight dtype, and LoRA adapters
//! as one allocation of factors plus a descriptor table (`LoraSlot` per (layer, module)) that
//! the SGMV / BGMV kernels index, so per-step metadata only names adapters, never factors.
use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};

use bytemuck::{Pod, Zeroable};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};

use super::encode::encode_jobs;
use super::launch::dptr;
use super::{CudaError, DType};
use crate::adapter::{LoraAdapter, LoraModule};

/// A `[d_out, d_in]` matrix (or the embedding table) with an optional bias.
pub struct CudaLinear {
    pub(super) w: CudaSlice<u8>,
    pub(super) bias: Option<CudaSlice<u8>>,
    pub d_out: usize,
    pub d_in: usize,
}

/// A norm weight vector.
pub struct CudaVector {
    pub(super) v: CudaSlice<u8>,
    pub len: usize,
}

/// Mirrors `struct LoraSlot` in thaw-kernels' `common.cuh` (32 bytes).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, Pod, Zeroable)]
pub(super) struct LoraSlot {
    pub a: u64,
    pub b: u64,
    pub rank: u32,
    pub scale: f32,
    pub reserved: u64,
}

const _: () = assert!(std::mem::size_of::<LoraSlot>() == 32);

// SAFETY: LoraSlot is #[repr(C)] plain data (u64, u64, u32, f32, u64) with the layout of the
// device struct; any bit pattern is valid.
unsafe impl DeviceRepr for LoraSlot {}

/// One adapter on the device.
pub struct CudaLora {
    /// All factors, each 256-byte aligned.
    pub(super) _weights: CudaSlice<u8>,
    /// `[n_layers * 7]` LoraSlot.
    pub(super) _table: CudaSlice<LoraSlot>,
    /// Host copy of the ranks, `[layer][module]` (0 = not targeted).
    pub(super) ranks: Vec<[u32; 7]>,
    pub(super) table_addr: u64,
    /// Streamed adapters: one event per layer on the copy stream (empty = all resident).
    pub(super) events: Vec<CudaEvent>,
    /// Layers seen landed so far (a cache of the event polls).
    pub(super) landed: AtomicUsize,
    /// Page-locked source of a streamed adapter's copies, kept until they complete.
    pub(super) _staging: Option<PinnedHostSlice<u8>>,
}

impl Drop for CudaLora {
    fn drop(&mut self) {
        // In-flight copies read `staging` and write `weights`: let them finish first.
        if let Some(last) = self.events.last() {
            let _ = last.synchronize();
        }
    }
}

impl CudaLora {
    /// Rank at (layer, module), 0 when the adapter does not target it.
    pub fn rank(&self, layer: usize, m: LoraModule) -> usize {
        self.ranks.get(layer).map_or(0, |r| r[m.index()] as usize)
    }

    pub fn num_layers(&self) -> usize {
        self.ranks.len()
    }

    /// Layers `0..n` are on the device (polls the per-layer copy events; never blocks).
    pub fn landed_layers(&self) -> usize {
        if self.events.is_empty() {
            return self.ranks.len();
        }
        let mut n = self.landed.load(Ordering::Acquire);
        while n < self.events.len() && self.events[n].is_complete() {
            n += 1;
        }
        self.landed.store(n, Ordering::Release);
        n
    }
}

/// f32 values in `dt`'s little-endian bytes.
pub(super) fn upload_bytes(
    stream: &Arc<CudaStream>,
    bytes: &[u8],
) -> Result<CudaSlice<u8>, CudaError> {
    if bytes.is_empty() {
        return Ok(stream.alloc_zeros::<u8>(1)?);
    }
    Ok(stream.clone_htod(bytes)?)
}

fn align(x: usize) -> usize {
    x.next_multiple_of(256)
}

/// One (layer, module) pair of factors in an adapter's device allocation.
#[derive(Copy, Clone, Debug)]
pub(super) struct Placed {
    pub layer: usize,
    pub module: LoraModule,
    pub rank: u32,
    pub scale: f32,
    /// Byte offsets of A and B.
    pub a_off: usize,
    pub b_off: usize,
    pub b_len: usize,
}

/// Where each factor of an adapter goes in its single device allocation.
pub(super) struct LoraPlan {
    pub entries: Vec<Placed>,
    pub total: usize,
    pub n_layers: usize,
}

impl LoraPlan {
    pub fn new(
        n_layers: usize,
        factors: impl Iterator<Item = (usize, LoraModule, u32, f32, usize, usize)>,
    ) -> Self {
        let mut entries = Vec::new();
        let mut off = 0;
        for (layer, m, rank, scale, a_len, b_len) in factors {
            let a_off = off;
            let b_off = align(a_off + a_len);
            off = align(b_off + b_len);
            entries.push(Placed {
                layer,
                module: m,
                rank,
                scale,
                a_off,
                b_off,
                b_len,
            });
        }
        Self {
            entries,
            total: off.max(256),
            n_layers,
        }
    }

    /// Bytes of layer `l`'s factors: `[start, end)` in the allocation (empty if none).
    pub fn layer_range(&self, l: usize) -> (usize, usize) {
        let mut it = self.entries.iter().filter(|e| e.layer == l);
        let Some(first) = it.next() else {
            return (0, 0);
        };
        let last = it.next_back().unwrap_or(first);
        (first.a_off, last.b_off + last.b_len)
    }

    /// Uploads the descriptor table for factors placed in `weights` as planned.
    pub fn finish(
        &self,
        stream: &Arc<CudaStream>,
        weights: CudaSlice<u8>,
        events: Vec<CudaEvent>,
        staging: Option<PinnedHostSlice<u8>>,
    ) -> Result<CudaLora, CudaError> {
        let base = dptr(&weights, stream);
        let mut slots = vec![LoraSlot::default(); self.n_layers.max(1) * 7];
        let mut ranks = vec![[0u32; 7]; self.n_layers];
        for &Placed {
            layer,
            module: m,
            rank,
            scale,
            a_off,
            b_off,
            ..
        } in &self.entries
        {
            slots[layer * 7 + m.index()] = LoraSlot {
                a: base + a_off as u64,
                b: base + b_off as u64,
                rank,
                scale,
                reserved: 0,
            };
            ranks[layer][m.index()] = rank;
        }
        let table = stream.clone_htod(&slots)?;
        let table_addr = dptr(&table, stream);
        Ok(CudaLora {
            _weights: weights,
            _table: table,
            ranks,
            table_addr,
            events,
            landed: AtomicUsize::new(0),
            _staging: staging,
        })
    }
}

/// The plan for a host adapter in `dt`: factors layer by layer, layer 0 first.
pub(super) fn plan_lora(adapter: &LoraAdapter, dt: DType) -> LoraPlan {
    let es = dt.size();
    LoraPlan::new(
        adapter.num_layers(),
        adapter
            .iter()
            .map(|(l, m, w)| (l, m, w.rank as u32, w.scale, w.a.len() * es, w.b.len() * es)),
    )
}

/// Writes `adapter`'s factors in `dt` into `host` (`plan.total` bytes) as `plan` places them,
/// converting on all cores.
pub(super) fn pack_lora(adapter: &LoraAdapter, dt: DType, plan: &LoraPlan, host: &mut [u8]) {
    let mut regions: Vec<(usize, &[f32])> = Vec::with_capacity(2 * plan.entries.len());
    for ((_, _, w), p) in adapter.iter().zip(&plan.entries) {
        regions.push((p.a_off, &w.a));
        regions.push((p.b_off, &w.b));
    }
    regions.sort_by_key(|r| r.0);
    // Carve `host` into the regions' disjoint destinations, in offset order.
    let mut jobs = Vec::with_capacity(regions.len());
    let (mut rest, mut at) = (host, 0usize);
    for (off, src) in regions {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - at);
        let (dst, tail) = tail.split_at_mut(src.len() * dt.size());
        jobs.push((src, dst));
        rest = tail;
        at = off + src.len() * dt.size();
    }
    encode_jobs(jobs, dt);
}

/// Converts a host adapter to `dt` and uploads it (synchronously on `stream`).
pub(super) fn upload_lora(
    stream: &Arc<CudaStream>,
    adapter: &LoraAdapter,
    dt: DType,
) -> Result<CudaLora, CudaError> {
    let plan = plan_lora(adapter, dt);
    let mut host = vec![0u8; plan.total];
    pack_lora(adapter, dt, &plan, &mut host);
    let weights = upload_bytes(stream, &host)?;
    plan.finish(stream, weights, Vec::new(), None)
}
