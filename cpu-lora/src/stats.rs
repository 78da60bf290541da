//! The step-statistics segment: one 64-byte slot per worker where the worker records, for
//! the step it is about to report complete, how long it computed and how many rows. The
//! engine reads it after `wait_results` (the worker's Release store of its result word
//! orders these writes before it), so "IPC time = round trip − compute" and the online
//! profile use times measured inside the worker.
//!
//! It is a `SegmentKind::Scratch` segment (magic, version, size checked by `thaw-ipc`)
//! whose config words carry this crate's own tag, version and worker count, checked by
//! [`StatsSegment::open`]: a segment of another layout is an error, never misread.
//!
//! ```text
//! slot w at HEADER_LEN + 64·w:  seq u32 | rows u32 | compute_ns u64 | failed u32 | steps u32
//! ```

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use thaw_ipc::{IpcError, Segment, SegmentKind, StepSeq, WorkerId, HEADER_LEN};

use crate::CpuLoraError;

/// Config word 0 of a stats segment: `"THAWLSTA"`.
const STATS_TAG: u64 = u64::from_le_bytes(*b"THAWLSTA");
/// Bump on any change to the slot layout.
pub const STATS_VERSION: u64 = 1;
const SLOT: usize = 64;
const SEQ: usize = 0;
const ROWS: usize = 4;
const NS: usize = 8;
const FAILED: usize = 16;

/// What a worker recorded for one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerStepStat {
    /// The step the record belongs to.
    pub seq: StepSeq,
    /// Rows computed (summed over modules).
    pub rows: u32,
    /// Wall time spent computing the step inside the worker.
    pub compute_ns: u64,
    /// (job, module) pairs that could not be computed.
    pub failed: u32,
}

/// A mapped stats segment (engine and worker sides).
#[derive(Debug)]
pub struct StatsSegment {
    seg: Segment,
    workers: u32,
}

impl StatsSegment {
    /// Creates a zeroed stats segment for `workers` slots.
    pub fn create(workers: u32) -> Result<Self, CpuLoraError> {
        let seg = Segment::create_with_config(
            SegmentKind::Scratch,
            "lora-stats",
            workers as usize * SLOT,
            &[STATS_TAG, STATS_VERSION, u64::from(workers)],
        )?;
        Self::open(seg)
    }

    /// Validates an opened scratch segment as a stats segment of this version.
    pub fn open(seg: Segment) -> Result<Self, CpuLoraError> {
        let w = seg.config_words();
        if w[0] != STATS_TAG || w[1] != STATS_VERSION {
            return Err(IpcError::CorruptHeader(format!(
                "not a CPU LoRA stats segment of version {STATS_VERSION} (tag {:#x}, version {})",
                w[0], w[1]
            ))
            .into());
        }
        let workers = u32::try_from(w[2]).unwrap_or(u32::MAX);
        if HEADER_LEN + workers as usize * SLOT > seg.len() {
            return Err(IpcError::CorruptHeader(format!(
                "stats segment of {} bytes cannot hold {workers} slots",
                seg.len()
            ))
            .into());
        }
        Ok(Self { seg, workers })
    }

    /// The segment (for `inherit_into`).
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    fn off(&self, w: WorkerId, field: usize) -> Option<usize> {
        (w.0 < self.workers).then(|| HEADER_LEN + w.0 as usize * SLOT + field)
    }

    /// Worker side: records `stat` (call before reporting the step complete, whose Release
    /// store publishes it).
    pub fn record(&self, w: WorkerId, stat: WorkerStepStat) {
        let Some(base) = self.off(w, 0) else { return };
        self.seg.atomic_u32(base + ROWS).store(stat.rows, Relaxed);
        self.seg
            .atomic_u64(base + NS)
            .store(stat.compute_ns, Relaxed);
        self.seg
            .atomic_u32(base + FAILED)
            .store(stat.failed, Relaxed);
        self.seg.atomic_u32(base + SEQ).store(stat.seq.0, Release);
    }

    /// Engine side: the last record of worker `w` (after its result word was observed).
    pub fn read(&self, w: WorkerId) -> WorkerStepStat {
        let Some(base) = self.off(w, 0) else {
            return WorkerStepStat::default();
        };
        let seq = StepSeq(self.seg.atomic_u32(base + SEQ).load(Acquire));
        WorkerStepStat {
            seq,
            rows: self.seg.atomic_u32(base + ROWS).load(Relaxed),
            compute_ns: self.seg.atomic_u64(base + NS).load(Relaxed),
            failed: self.seg.atomic_u32(base + FAILED).load(Relaxed),
        }
    }
}
