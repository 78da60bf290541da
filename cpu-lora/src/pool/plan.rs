//! Turning a step's [`LoraJob`]s into the exchange's job table: shapes resolved from the host
//! store (arena or file entries) and checked against the exchange, rows split across ready workers by the profile.

use thaw_ipc::{Job, WorkerId};

use super::{Assignment, JobInfo, LoraJob, LoraPool};
use crate::procs::{Slot, SlotState};
use crate::profile::{split_rows, ShapeKey};
use crate::CpuLoraError;

impl LoraPool {
    /// Checks every job against the exchange and the store; fills `infos`.
    pub(super) fn resolve(&mut self, jobs: &[LoraJob]) -> Result<(), CpuLoraError> {
        let c = *self.ex.config();
        self.infos.clear();
        for (index, j) in jobs.iter().enumerate() {
            let bad = |reason: String| CpuLoraError::InvalidJob { index, reason };
            if j.rows.start > j.rows.end || j.rows.end > c.max_rows {
                return Err(bad(format!("rows {:?} outside 0..{}", j.rows, c.max_rows)));
            }
            if j.input >= c.max_inputs {
                return Err(bad(format!(
                    "input {} >= max_inputs {}",
                    j.input, c.max_inputs
                )));
            }
            if j.modules.0 == 0 || j.modules.0 >> 7 != 0 {
                return Err(bad(format!(
                    "module mask {:#b} is empty or invalid",
                    j.modules.0
                )));
            }
            let mut info = JobInfo {
                keys: [None; 7],
                n_modules: 0,
            };
            for m in j.modules.iter() {
                // From the arena or, for a file entry, the adapter's file.
                let v = self.store.shape(j.adapter, j.layer, m).ok_or_else(|| {
                    bad(format!(
                        "adapter {} gen {} has no weights for layer {} {m:?} in the host store",
                        j.adapter.id.0, j.adapter.generation.0, j.layer.0
                    ))
                })?;
                if v.d_in > c.max_d_in || v.d_out > c.max_d_out {
                    return Err(bad(format!(
                        "{m:?} is {}→{}, above the exchange's {}→{}",
                        v.d_in, v.d_out, c.max_d_in, c.max_d_out
                    )));
                }
                info.keys[m.index()] = Some(ShapeKey {
                    rank: v.rank,
                    d_in: v.d_in,
                    d_out: v.d_out,
                    dtype: v.dtype,
                });
                info.n_modules += 1;
            }
            self.infos.push(info);
        }
        Ok(())
    }

    /// Splits each job's rows over the ready workers (equal predicted finish times).
    pub(super) fn split(&mut self, jobs: &[LoraJob]) -> Result<(), CpuLoraError> {
        self.jobs.clear();
        self.assignments.clear();
        self.usage.iter_mut().for_each(Vec::clear);
        self.cands.clear();
        let ready = |s: &Slot| s.state == SlotState::Ready;
        let starting = |s: &Slot| s.state == SlotState::Starting;
        if self.slots.iter().any(ready) {
            self.cands
                .extend((0..self.slots.len()).filter(|&w| ready(&self.slots[w])));
        } else if self.slots.iter().any(starting) {
            self.cands
                .extend((0..self.slots.len()).filter(|&w| starting(&self.slots[w])));
        } else {
            // Nobody alive: post to slot 0 anyway; wait() computes it in the engine.
            self.cands.push(0);
        }
        self.loads.iter_mut().for_each(|l| *l = 0.0);
        let max_jobs = self.ex.config().max_jobs as usize;
        let nonempty = jobs.iter().filter(|j| !j.rows.is_empty()).count();
        if nonempty > max_jobs {
            return Err(CpuLoraError::InvalidJob {
                index: max_jobs,
                reason: format!("{nonempty} jobs, the exchange holds {max_jobs}"),
            });
        }
        let mut left = nonempty;
        let n = self.cands.len();
        for (ji, j) in jobs.iter().enumerate() {
            if j.rows.is_empty() {
                continue;
            }
            left -= 1;
            let info = self.infos[ji];
            for (k, &w) in self.cands.iter().enumerate() {
                self.costs[k] = info
                    .keys
                    .iter()
                    .flatten()
                    .map(|&key| self.profile.ns_per_row(w, key))
                    .sum();
            }
            let mut loads = [0.0f64; 64];
            for (k, &w) in self.cands.iter().enumerate() {
                loads[k] = self.loads[w];
            }
            let room = max_jobs - self.jobs.len() - left;
            let (first_key, cands) = (info.keys.iter().flatten().next().copied(), &self.cands);
            let (out_jobs, out_asg, usage) =
                (&mut self.jobs, &mut self.assignments, &mut self.usage);
            let v = first_key.expect("resolve checked at least one module");
            let scale = self
                .store
                .shape(
                    j.adapter,
                    j.layer,
                    j.modules.iter().next().expect("non-empty"),
                )
                .map_or(1.0, |v| v.scale);
            split_rows(
                j.rows.clone(),
                &self.costs[..n],
                &mut loads[..n],
                self.cfg.min_chunk_rows,
                room,
                |k, rows| {
                    let w = cands[k];
                    out_jobs.push(Job {
                        adapter: j.adapter,
                        layer: j.layer,
                        modules: j.modules,
                        worker: WorkerId(w as u32),
                        input: j.input,
                        row_start: rows.start,
                        row_count: rows.len() as u32,
                        rank: v.rank,
                        scale,
                        dtype: v.dtype.code(),
                        _pad: 0,
                    });
                    out_asg.push(Assignment {
                        job: ji as u32,
                        worker: WorkerId(w as u32),
                        rows: rows.clone(),
                        recovered: false,
                    });
                    for key in info.keys.iter().flatten() {
                        usage[w].push((*key, rows.len() as u32));
                    }
                },
            );
            for (k, &w) in self.cands.iter().enumerate() {
                self.loads[w] = loads[k];
            }
        }
        // A ready worker left idle by a step that had rows for everyone: its estimate may be
        // stale or pessimistic; without rows it would never be corrected.
        let total: u32 = jobs.iter().map(|j| j.rows.len() as u32).sum();
        if n > 1 && total >= self.cfg.min_chunk_rows * n as u32 {
            for &w in &self.cands {
                if self.loads[w] == 0.0 {
                    self.profile.forgive(w, 0.7);
                }
            }
        }
        Ok(())
    }
}
