//! Per-step device metadata, built on the host once per step from the engine's `StepLayout`
//! and `LoraLayout` (the pure builders of `backend::step_meta`) and reused by every layer
//! (Punica: segment indices built once per step).
//! Buffers grow to the largest step seen and are then reused; host staging vectors likewise.
use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};

use super::launch::Gpu;
use super::weights::CudaLora;
use super::CudaError;
use crate::backend::step_meta::{AttnHost, AttnParts, LoraHost};
use crate::backend::{LoraLayout, StepLayout};

/// A device buffer that grows to the largest upload and a host staging vector.
pub(super) struct DevVec<T: DeviceRepr> {
    pub host: Vec<T>,
    pub dev: Option<CudaSlice<T>>,
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy> DevVec<T> {
    pub fn new() -> Self {
        Self {
            host: Vec::new(),
            dev: None,
        }
    }

    /// Copies `host` to the device (at least one element is allocated so kernels always get a
    /// valid pointer).
    pub fn upload(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let host = std::mem::take(&mut self.host);
        let r = self.upload_slice(gpu, &host);
        self.host = host;
        r
    }

    /// Copies `data` to the device buffer, growing it if needed.
    pub fn upload_slice(&mut self, gpu: &Gpu, data: &[T]) -> Result<(), CudaError> {
        let n = data.len().max(1);
        if self.dev.as_ref().is_none_or(|d| d.len() < n) {
            self.dev = Some(gpu.alloc_zeros::<T>(n.next_power_of_two())?);
        }
        if let Some(d) = self.dev.as_mut() {
            if !data.is_empty() {
                let mut view = d.slice_mut(..data.len());
                gpu.htod(data, &mut view)?;
            }
        }
        Ok(())
    }

    pub fn get(&self) -> &CudaSlice<T> {
        self.dev
            .as_ref()
            .expect("DevVec used before its first upload")
    }
}

/// Attention metadata of one step: built on the host by [`AttnHost`], uploaded once, in one
/// copy (the four arrays packed one after another, [`AttnHost::pack`]).
pub(super) struct AttnMeta {
    pub host: AttnHost,
    /// Slots, tables, decode rows and tiles, packed.
    packed: DevVec<u32>,
    parts: AttnParts,
    /// Flash-decoding's partial outputs and (max, sum) pairs (`flash.rs`), grown on demand.
    pub split_acc: Option<CudaSlice<f32>>,
    pub split_ml: Option<CudaSlice<f32>>,
}

impl AttnMeta {
    pub fn new() -> Self {
        Self {
            host: AttnHost::default(),
            packed: DevVec::new(),
            parts: AttnParts::default(),
            split_acc: None,
            split_ml: None,
        }
    }

    fn part(&self, r: &Range<usize>) -> CudaView<'_, u32> {
        self.packed.get().slice(r.clone())
    }

    /// Cache slot per row.
    pub fn slots(&self) -> CudaView<'_, u32> {
        self.part(&self.parts.slots)
    }

    /// The step's block tables, concatenated.
    pub fn tables(&self) -> CudaView<'_, u32> {
        self.part(&self.parts.tables)
    }

    /// (table offset, position, row) per decode row.
    pub fn decode(&self) -> CudaView<'_, u32> {
        self.part(&self.parts.decode)
    }

    /// (table offset, first position, first row, rows) per prefill tile.
    pub fn tiles(&self) -> CudaView<'_, u32> {
        self.part(&self.parts.tiles)
    }

    pub fn n_decode(&self) -> usize {
        self.host.n_decode()
    }

    pub fn n_tiles(&self) -> usize {
        self.host.n_tiles()
    }

    /// Builds and uploads the metadata for `step`; `num_blocks` bounds every table entry;
    /// prefill tiles of at most `tile_rows` rows (the prefill kernel's query tile).
    pub fn build(
        &mut self,
        gpu: &Gpu,
        step: &StepLayout,
        (block_size, num_blocks): (usize, usize),
        tile_rows: usize,
    ) -> Result<(), CudaError> {
        let h = &mut self.host;
        h.build(step, block_size, num_blocks, tile_rows);
        self.parts = h.pack(&mut self.packed.host);
        self.packed.upload(gpu)
    }
}

/// LoRA metadata of one step: built on the host by [`LoraHost`], uploaded once.
pub(super) struct LoraMeta {
    pub host: LoraHost,
    pub seg_tables: DevVec<u64>,
    pub seg_rows: DevVec<u32>,
    pub row_tables: DevVec<u64>,
}

impl LoraMeta {
    pub fn new() -> Self {
        Self {
            host: LoraHost::default(),
            seg_tables: DevVec::new(),
            seg_rows: DevVec::new(),
            row_tables: DevVec::new(),
        }
    }

    pub fn n_segs(&self) -> usize {
        self.host.n_segs()
    }

    /// Rows of the longest segment.
    pub fn max_seg_rows(&self) -> usize {
        self.host.max_seg_rows()
    }

    pub fn build(
        &mut self,
        gpu: &Gpu,
        layout: &LoraLayout,
        adapters: &[&CudaLora],
        on_device: &[bool],
    ) -> Result<(), CudaError> {
        let h = &mut self.host;
        h.build(layout, |i| {
            on_device[i as usize].then(|| adapters[i as usize].table_addr)
        });
        self.seg_tables.upload_slice(gpu, &h.seg_tables)?;
        self.seg_rows.upload_slice(gpu, &h.seg_rows)?;
        self.row_tables.upload_slice(gpu, &h.row_tables)
    }
}
