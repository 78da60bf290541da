//! Weights on the device: matrices and norms in the backend's weight dtype, and LoRA adapters
//! as one allocation of factors plus a descriptor table (`LoraSlot` per (layer, module)) that
//! the SGMV / BGMV kernels index, so per-step metadata only names adapters, never factors.
use std::ops::Range;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr};
use thaw_kernels::cpu::{WeightData, WeightMatrix};

use super::launch::dptr;
use super::upload::{CudaDst, LayerLanding};
use super::{CudaError, DType};
use crate::adapter::{LoraAdapter, LoraModule, WeightDtype};

/// A matrix's bytes on the device: an allocation of its own, or its range of one allocation
/// shared with the other matrices of its group (q/k/v, gate/up: `group.rs`), placed back to
/// back so that the group is one `[Σ d_out, d_in]` matrix.
pub(super) struct WeightBytes {
    buf: Arc<CudaSlice<u8>>,
    range: Range<usize>,
}

impl WeightBytes {
    /// An allocation of its own.
    pub fn own(buf: CudaSlice<u8>) -> Self {
        let range = 0..buf.len();
        Self {
            buf: Arc::new(buf),
            range,
        }
    }

    /// `range` of the shared allocation `buf`.
    pub fn shared(buf: &Arc<CudaSlice<u8>>, range: Range<usize>) -> Self {
        assert!(
            range.end <= buf.len(),
            "weight range outside its allocation"
        );
        Self {
            buf: buf.clone(),
            range,
        }
    }

    /// The matrix's bytes.
    pub fn view(&self) -> CudaView<'_, u8> {
        self.buf.slice(self.range.clone())
    }

    /// Whether `next` starts in the same allocation where this one ends.
    pub fn followed_by(&self, next: &WeightBytes) -> bool {
        Arc::ptr_eq(&self.buf, &next.buf) && self.range.end == next.range.start
    }

    /// The bytes of this matrix through the end of `last` (a run checked with
    /// [`WeightBytes::followed_by`]).
    pub fn through<'a>(&'a self, last: &WeightBytes) -> CudaView<'a, u8> {
        assert!(
            Arc::ptr_eq(&self.buf, &last.buf) && self.range.start <= last.range.end,
            "not one run of a shared allocation"
        );
        self.buf.slice(self.range.start..last.range.end)
    }
}

/// A `[d_out, d_in]` matrix (or the embedding table) with an optional bias.
pub struct CudaLinear {
    pub(super) w: WeightBytes,
    pub(super) bias: Option<CudaSlice<u8>>,
    /// The bias in f32 for cuBLASLt's epilogue (`lt.rs`): made at load while it is on.
    pub(super) bias32: Option<CudaSlice<f32>>,
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
    /// All factors, each 256-byte aligned: an allocation, or a run of KV blocks.
    pub(super) _weights: Arc<CudaDst>,
    /// `[n_layers * 7]` LoraSlot.
    pub(super) _table: CudaSlice<LoraSlot>,
    /// Host copy of the ranks, `[layer][module]` (0 = not targeted).
    pub(super) ranks: Vec<[u32; 7]>,
    pub(super) table_addr: u64,
    /// A streamed adapter's landed layers, published by the upload pipeline's copy thread
    /// after each layer's event (`None`: every layer resident). The pipeline holds `weights`
    /// too until its last copy completed, so dropping this never frees memory a copy writes.
    pub(super) landing: Option<Arc<LayerLanding>>,
}

impl CudaLora {
    /// Rank at (layer, module), 0 when the adapter does not target it.
    pub fn rank(&self, layer: usize, m: LoraModule) -> usize {
        self.ranks.get(layer).map_or(0, |r| r[m.index()] as usize)
    }

    pub fn num_layers(&self) -> usize {
        self.ranks.len()
    }

    /// Layers `0..n` are on the device (an atomic the copy thread publishes; never blocks).
    pub fn landed_layers(&self) -> usize {
        self.landing
            .as_ref()
            .map_or(self.ranks.len(), |l| l.landed())
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

/// Where each factor of an adapter goes in its single device allocation (the upload
/// pipeline's image layout).
pub(super) use crate::upload::{ImageLayout as LoraPlan, Placed};

/// Uploads the descriptor table for factors placed in `weights` as `plan` places them;
/// `landing` tracks a streamed adapter's layers (`None`: every layer resident).
pub(super) fn finish_lora(
    plan: &LoraPlan,
    stream: &Arc<CudaStream>,
    weights: Arc<CudaDst>,
    landing: Option<Arc<LayerLanding>>,
) -> Result<CudaLora, CudaError> {
    let at = |off: usize| weights.addr(stream, off);
    let mut slots = vec![LoraSlot::default(); plan.n_layers.max(1) * 7];
    let mut ranks = vec![[0u32; 7]; plan.n_layers];
    for &Placed {
        layer,
        module: m,
        rank,
        scale,
        a_off,
        b_off,
        ..
    } in &plan.entries
    {
        slots[layer * 7 + m.index()] = LoraSlot {
            a: at(a_off),
            b: at(b_off),
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
        landing,
    })
}

/// The plan for a host adapter in `dt`: factors layer by layer, layer 0 first.
pub(super) fn plan_lora(adapter: &LoraAdapter, dt: DType) -> LoraPlan {
    LoraPlan::of(adapter, Some(weight_dtype(dt)))
}

/// A matrix's bytes in the weight dtype `dt` as stored, if it is stored in `dt`: uploaded as
/// they are, with no f32 copy on the host and no conversion pass.
pub(super) fn stored_bytes(w: &WeightMatrix, dt: DType) -> Option<&[u8]> {
    match (w.data(), dt) {
        (WeightData::BF16(v), DType::Bf16) => Some(bytemuck::cast_slice(&v[..])),
        (WeightData::F16(v), DType::F16) => Some(bytemuck::cast_slice(&v[..])),
        (WeightData::F32(v), DType::F32) => Some(bytemuck::cast_slice(&v[..])),
        _ => None,
    }
}

/// The runtime's name for a kernel dtype.
pub(super) fn weight_dtype(dt: DType) -> WeightDtype {
    match dt {
        DType::F32 => WeightDtype::F32,
        DType::F16 => WeightDtype::F16,
        DType::Bf16 => WeightDtype::Bf16,
    }
}
