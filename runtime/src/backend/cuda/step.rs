//! Per-step device metadata, built on the host once per step from the engine's `StepLayout`
//! and `LoraLayout` and reused by every layer (Punica: segment indices built once per step).
//! Buffers grow to the largest step seen and are then reused; host staging vectors likewise.
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use thaw_kernels::cuda::registry::shape;

use super::weights::CudaLora;
use super::CudaError;
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
    pub fn upload(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        let n = self.host.len().max(1);
        if self.dev.as_ref().is_none_or(|d| d.len() < n) {
            self.dev = Some(stream.alloc_zeros::<T>(n.next_power_of_two())?);
        }
        if let Some(d) = self.dev.as_mut() {
            if !self.host.is_empty() {
                let mut view = d.slice_mut(..self.host.len());
                stream.memcpy_htod(&self.host, &mut view)?;
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

/// Attention metadata of one step.
pub(super) struct AttnMeta {
    /// Cache slot per row.
    pub slots: DevVec<u32>,
    pub tables: DevVec<u32>,
    /// (table offset, position, row) per decode row.
    pub decode: DevVec<u32>,
    /// (table offset, first position, first row, rows) per prefill tile.
    pub tiles: DevVec<u32>,
    /// Flash-decoding's partial outputs and (max, sum) pairs (`flash.rs`), grown on demand.
    pub split_acc: Option<CudaSlice<f32>>,
    pub split_ml: Option<CudaSlice<f32>>,
}

impl AttnMeta {
    pub fn new() -> Self {
        Self {
            slots: DevVec::new(),
            tables: DevVec::new(),
            decode: DevVec::new(),
            tiles: DevVec::new(),
            split_acc: None,
            split_ml: None,
        }
    }

    pub fn n_decode(&self) -> usize {
        self.decode.host.len() / 3
    }

    pub fn n_tiles(&self) -> usize {
        self.tiles.host.len() / 4
    }

    /// Builds and uploads the metadata for `step`; `num_blocks` bounds every table entry.
    pub fn build(
        &mut self,
        stream: &Arc<CudaStream>,
        step: &StepLayout,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<(), CudaError> {
        self.slots.host.clear();
        self.slots.host.resize(step.rows(), 0);
        self.decode.host.clear();
        self.tiles.host.clear();
        self.tables.host.clear();
        self.tables.host.extend_from_slice(&step.block_tables);
        for s in &step.seqs {
            let table = &step.block_tables[s.blocks.clone()];
            let last = s.start_pos + s.rows.len();
            assert!(
                table.len() * block_size >= last,
                "attention: block table of {} blocks cannot hold {last} positions",
                table.len()
            );
            assert!(
                table.iter().all(|&b| (b as usize) < num_blocks),
                "attention: block table names a block beyond the {num_blocks} allocated"
            );
            for (i, r) in s.rows.clone().enumerate() {
                let pos = s.start_pos + i;
                self.slots.host[r] =
                    table[pos / block_size] * block_size as u32 + (pos % block_size) as u32;
            }
            let off = s.blocks.start as u32;
            if s.rows.len() == 1 {
                self.decode
                    .host
                    .extend([off, s.start_pos as u32, s.rows.start as u32]);
            } else {
                for t0 in s.rows.clone().step_by(shape::PREFILL_Q) {
                    let n = (s.rows.end - t0).min(shape::PREFILL_Q);
                    let pos0 = s.start_pos + (t0 - s.rows.start);
                    self.tiles
                        .host
                        .extend([off, pos0 as u32, t0 as u32, n as u32]);
                }
            }
        }
        self.slots.upload(stream)?;
        self.tables.upload(stream)?;
        self.decode.upload(stream)?;
        self.tiles.upload(stream)
    }
}

/// LoRA metadata of one step: SGMV segments and BGMV per-row tables, both naming adapters by
/// their descriptor table's device address.
pub(super) struct LoraMeta {
    pub seg_tables: DevVec<u64>,
    pub seg_rows: DevVec<u32>,
    pub row_tables: DevVec<u64>,
}

impl LoraMeta {
    pub fn new() -> Self {
        Self {
            seg_tables: DevVec::new(),
            seg_rows: DevVec::new(),
            row_tables: DevVec::new(),
        }
    }

    pub fn n_segs(&self) -> usize {
        self.seg_tables.host.len()
    }

    /// Rows of the longest segment.
    pub fn max_seg_rows(&self) -> usize {
        self.seg_rows
            .host
            .chunks_exact(2)
            .map(|r| (r[1] - r[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    pub fn build(
        &mut self,
        stream: &Arc<CudaStream>,
        layout: &LoraLayout,
        adapters: &[&CudaLora],
        on_device: &[bool],
    ) -> Result<(), CudaError> {
        self.seg_tables.host.clear();
        self.seg_rows.host.clear();
        for (rows, idx) in &layout.segments {
            if rows.is_empty() || !on_device[*idx as usize] {
                continue;
            }
            self.seg_tables
                .host
                .push(adapters[*idx as usize].table_addr);
            self.seg_rows
                .host
                .extend([rows.start as u32, rows.end as u32]);
        }
        self.row_tables.host.clear();
        self.row_tables
            .host
            .extend(layout.row_adapter.iter().map(|i| match i {
                Some(i) if on_device[*i as usize] => adapters[*i as usize].table_addr,
                _ => 0,
            }));
        self.seg_tables.upload(stream)?;
        self.seg_rows.upload(stream)?;
        self.row_tables.upload(stream)
    }
}
