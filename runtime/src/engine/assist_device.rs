//! CPU assist through the device's exchange (DESIGN §4, CaraServe's fused copy-and-signal):
//! on a backend that maps the worker pool's exchange ([`Backend::map_assist_exchange`], CUDA),
//! a group's cold rows leave the device by a kernel that also writes the step's sequence word
//! the workers spin on, and its deltas come back by a kernel the stream holds until every
//! worker of the step has published (`cuStreamWaitValue32`). The host posts the job table and
//! queues; it never synchronises the stream, and waits for the workers only to close the
//! pool's step before the next group's (by then the device has the merges queued).
use std::ops::Range;
use std::time::Instant;

use thaw_ipc::{StepSeq, WorkerId};

use super::assist::{cold_jobs, pool_err, Assist, AssistPath, ColdSeg};
use crate::adapter::LoraModule;
use crate::backend::Backend;
use crate::error::Result;

/// Per-step state of the device path (buffers reused across groups).
#[derive(Default)]
pub(crate) struct DeviceAssist {
    /// The backend mapped the pool's exchange.
    pub mapped: bool,
    /// The current group went through the device; its step's sequence value.
    pub seq: Option<StepSeq>,
    rows: Vec<Range<usize>>,
    workers: Vec<WorkerId>,
}

impl Assist<'_> {
    /// Exports the cold rows `segs` of `x` through the device and posts their jobs, when the
    /// backend mapped the exchange and the group fits it. Returns whether it did; otherwise
    /// the caller takes the host path.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn begin_device<B: Backend>(
        &mut self,
        b: &mut B,
        x: &B::Buf,
        layer: usize,
        group: &[LoraModule],
        segs: &[ColdSeg],
        d_in: usize,
        d_out_max: usize,
    ) -> Result<bool> {
        self.buf.device.seq = None;
        let AssistPath::Pool {
            pool,
            handles,
            ticket,
        } = &mut self.path
        else {
            return Ok(false);
        };
        let n: usize = segs.iter().map(|s| s.packed.len()).sum();
        let cap = pool.exchange().config();
        if !self.buf.device.mapped
            || n > cap.max_rows as usize
            || d_in > cap.max_d_in as usize
            || d_out_max > cap.max_d_out as usize
        {
            return Ok(false);
        }
        let t0 = Instant::now();
        self.rows_assisted +=
            cold_jobs(self.host, handles, layer, group, segs, &mut self.buf.jobs)?;
        let step = pool.submit_device(&self.buf.jobs).map_err(pool_err)?;
        *ticket = Some(step.ticket);
        self.buf.device.workers.clear();
        for a in pool.last_assignments() {
            if !self.buf.device.workers.contains(&a.worker) {
                self.buf.device.workers.push(a.worker);
            }
        }
        self.buf.profile.groups += 1;
        let t1 = Instant::now();
        self.buf.profile.submit += t1 - t0;
        self.buf.device.rows.clear();
        self.buf
            .device
            .rows
            .extend(segs.iter().map(|s| s.rows.clone()));
        b.export_rows_device(x, d_in, &self.buf.device.rows, step.seq)?;
        self.buf.profile.export += t1.elapsed();
        self.buf.device.seq = Some(step.seq);
        Ok(true)
    }

    /// Queues the wait for the workers and the merge of each module's deltas into `outs`,
    /// then closes the pool's step. Only after [`Assist::begin_device`] returned true.
    pub(crate) fn end_device<B: Backend>(
        &mut self,
        b: &mut B,
        layer: usize,
        group: &[LoraModule],
        outs: &mut [&mut B::Buf],
        segs: &[ColdSeg],
        d_out: impl Fn(LoraModule) -> usize,
    ) -> Result<()> {
        let seq = self
            .buf
            .device
            .seq
            .take()
            .expect("end_device follows a begin_device that went through the device");
        let t0 = Instant::now();
        let queued = self.queue_merges(b, seq, layer, group, outs, segs, d_out);
        self.buf.profile.merge += t0.elapsed();
        // The stream holds the merges until the workers publish; the host waits for them
        // only to end the pool's step before the next group posts its own (also when queuing
        // failed, so the pool is not left with a step in flight).
        let finished = self.finish();
        queued.and(finished)
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_merges<B: Backend>(
        &mut self,
        b: &mut B,
        seq: StepSeq,
        layer: usize,
        group: &[LoraModule],
        outs: &mut [&mut B::Buf],
        segs: &[ColdSeg],
        d_out: impl Fn(LoraModule) -> usize,
    ) -> Result<()> {
        b.wait_workers_device(seq, &self.buf.device.workers)?;
        for (&m, y) in group.iter().zip(outs.iter_mut()) {
            let targets = |s: &ColdSeg| self.host[s.adapter as usize].get(layer, m).is_some();
            // Runs of consecutive segments that target `m`: their packed rows are contiguous
            // in the exchange's output, so one merge each.
            let mut i = 0;
            while i < segs.len() {
                if !targets(&segs[i]) {
                    i += 1;
                    continue;
                }
                let first = segs[i].packed.start;
                self.buf.device.rows.clear();
                while i < segs.len() && targets(&segs[i]) {
                    self.buf.device.rows.push(segs[i].rows.clone());
                    i += 1;
                }
                b.merge_rows_device(y, d_out(m), m, &self.buf.device.rows, first)?;
            }
        }
        Ok(())
    }
}
