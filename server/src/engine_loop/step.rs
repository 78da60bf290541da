//! One engine step: admission and the memory plan, the scheduler's token plan, the forward
//! pass with the cold-start gate, and the tokens sent back. Every decision it takes is a pure
//! function elsewhere (`crate::memory::admit`, `crate::scheduler`, [`super::gate`]); this is
//! where the loop carries them out and charges the time by cause.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use thaw_runtime::engine::FinishReason;
use thaw_runtime::ids::{AdapterId, SeqId};

use super::cold_marks::GateLog;
use super::gate::cold_gate;
use super::{kv, EngineEvent, Loop};
use crate::memory::apply::runnable_after_apply;
use crate::memory::waits::{classify, Moment, WaitReason, LOG_TARGET};
use crate::memory::{admit, MemView, Registered};
use crate::perf::{Cause, StepShape, Tier};
use crate::scheduler::{MemoryWait, SchedulingPolicy, SeqState};

impl Loop {
    /// Plans and runs one step; false if there was nothing to run.
    pub(super) fn step(&mut self) -> bool {
        self.fail_failed_uploads();
        let engine = &self.engine;
        self.mem.refresh_landed(|id| engine.adapter_landed(id));
        self.make_room();
        let wanted = self.state.waiting_adapters();
        let cost = &self.cold.cost;
        let reload = |tier: Tier, bytes: u64| cost.load_time_from(tier, bytes, 0);
        let kv_now = self.mem.pool().kv_capacity();
        self.sched.protect(&self.state, &self.cfg, cost, kv_now);
        let mut plan = {
            let engine = &self.engine;
            let registered = |a: AdapterId| engine.has_adapter(a);
            let view = MemView {
                registered: Registered::Engine(&registered),
                ..self.mem.view(&wanted, &reload)
            };
            admit(
                self.sched.candidate_order(&self.state),
                &self.state.running,
                self.state.reserved_blocks,
                &self.cfg,
                view,
                &self.limits,
            )
        };
        self.apply_memory(&plan, &wanted);
        // A load the engine refused leaves its requests waiting (queued, not failed).
        let (engine, waiting) = (&self.engine, &self.state.waiting);
        runnable_after_apply(
            &mut plan.admit,
            |id| waiting.iter().find(|s| s.id == id).and_then(|s| s.adapter),
            |a| engine.has_adapter(a),
        );
        self.engine.set_kv_capacity(self.mem.pool().kv_capacity());
        self.reshare_held();
        self.probe_prefixes(&plan.admit);
        let free = self.engine.kv_usage().free_blocks();
        let engine = &self.engine;
        let cold = &self.cold;
        let (running, max_batched) = (&self.state.running, self.cfg.max_num_batched_tokens);
        let gates = GateLog::default();
        let gate = |s: &SeqState, planned: usize| {
            let g = cold_gate(engine, cold, s, planned, running, max_batched);
            gates.record(s.id, s.adapter, g)
        };
        let kv_capacity = self.mem.pool().kv_capacity();
        let waits = self.memory_wait(&plan);
        let mut d = self.sched.plan(
            &self.state,
            &self.cfg,
            free,
            &gate,
            &self.cold.cost,
            &plan.admit,
            kv_capacity,
            &waits,
        );
        self.state.admit_ids(&d.admit, &self.cfg);
        for id in d.admit {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            let Some(l) = self.live.get_mut(&id) else {
                continue;
            };
            l.running = true;
            if let Some(lease) = &l.lease {
                self.mem.on_admit(lease.id(), l.missed);
            }
            let added = if l.preempted {
                l.preempted = false;
                self.engine.resume_sequence(id)
            } else {
                let params = l.params.take().unwrap_or_default();
                self.engine
                    .add_sequence(id, params)
                    .inspect(|&c| l.cached_tokens = c)
            };
            match added {
                Ok(cached) => kv::reconcile(&mut self.state, &mut d.plan, id, cached),
                Err(e) => {
                    // Requests are validated before submission; this is a bug or a race with an
                    // adapter unload, so the client gets the reason and the log the details.
                    tracing::warn!(seq = %id, "engine refused a request: {e}");
                    // A refused resume leaves the preempted sequence in the engine.
                    let _ = self.engine.remove_sequence(id);
                    let _ = l.events.send(EngineEvent::Aborted(format!(
                        "the engine refused the request: {e}"
                    )));
                    l.running = false;
                    self.state.remove(id, &self.cfg);
                    self.sched.remove(id);
                    self.live.remove(&id);
                    self.metrics.count_finished("abort");
                    d.plan.items.retain(|it| it.seq != id);
                }
            }
        }
        self.classify_waits(&plan, &d.plan);
        self.carry_out_gates(gates, &d.plan);
        if d.plan.items.is_empty() {
            return false;
        }
        debug_assert!(d.plan.items.iter().all(|it| {
            let s = self.state.running.iter().find(|s| s.id == it.seq);
            s.is_some_and(|s| {
                self.engine.blocks_needed(it.seq, it.num_tokens).ok()
                    == Some(s.blocks_needed(&self.cfg, it.num_tokens))
            })
        }));
        let (mut shape, decode_ctx) = self.step_shape(&d.plan);
        let kernel = if self.auto_kernel {
            let step = self.stats.steps.load(Ordering::Relaxed);
            let k = self.cold.cost.kernel_for_step(&shape, step);
            self.engine.set_lora_kernel(k);
            k
        } else {
            self.engine.engine_config().lora_kernel
        };
        let assisted_before = self.engine.rows_assisted();
        let profile_before = self.engine.assist_profile();
        let started = Instant::now();
        let idle = self
            .prev_step_end
            .map(|end| started.saturating_duration_since(end).as_secs_f64());
        shape.after_idle = self.cold.cost.is_after_idle(idle);
        let gap = self.last_step_end.take().map(|end| started - end);
        if let Some(g) = gap {
            self.cold.cost.observe_gap(g);
        }
        for it in &d.plan.items {
            if let Some(l) = self.live.get_mut(&it.seq) {
                l.planned.get_or_insert(started);
            }
        }
        self.charge(Cause::Forward);
        let stepped = self.engine.step(&d.plan);
        let outputs = match stepped {
            Ok(o) => o,
            Err(e) => {
                self.on_step_error(e, &d.plan);
                self.charge(Cause::Schedule);
                return true;
            }
        };
        if let Some(f) = &self.emulated_step {
            // The emulated device: the engine thread sleeps the rest of the GPU's step time
            // (the link's copies, the HTTP side and the CPU workers run meanwhile), so the
            // performance model below learns the padded time.
            let pad = f.pad(&shape, decode_ctx, started.elapsed());
            if !pad.is_zero() {
                std::thread::sleep(pad);
                self.stats
                    .emulated_pad_ns
                    .fetch_add(pad.as_nanos() as u64, Ordering::Relaxed);
            }
        }
        let elapsed = started.elapsed();
        self.charge(Cause::Schedule);
        self.last_step_end = Some(started + elapsed);
        self.prev_step_end = self.last_step_end;
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let assisted = self.engine.rows_assisted() - assisted_before;
        if let Some(log) = &mut self.step_log {
            log.step(
                &shape,
                decode_ctx,
                kernel == thaw_runtime::backend::LoraKernel::Bgmv,
                assisted > 0,
                started,
                elapsed.as_secs_f64(),
                gap.map(|g| g.as_secs_f64()),
                idle,
                self.clock.take_step(),
            );
        }
        if assisted == 0 {
            // Only steps the CPU did not stretch teach the model the device's speed.
            self.cold.cost.observe_shape(&shape, kernel, elapsed);
        } else {
            let overhead = self
                .engine
                .assist_profile()
                .since(&profile_before)
                .overhead();
            self.cold
                .cost
                .observe_assisted_shape(&shape, kernel, elapsed, overhead);
            self.stats.count_assisted(assisted);
        }
        let now = Instant::now();
        let planned: Vec<(SeqId, usize)> =
            d.plan.items.iter().map(|i| (i.seq, i.num_tokens)).collect();
        let mut sampled = Vec::with_capacity(outputs.len());
        let mut finished = Vec::new();
        let mut to_send = Vec::with_capacity(outputs.len());
        for o in outputs {
            sampled.push(o.seq);
            let Some(l) = self.live.get_mut(&o.seq) else {
                continue;
            };
            match l.last_token {
                None => {
                    let ttft = now.duration_since(l.arrived).as_secs_f64();
                    self.metrics.ttft.observe(ttft);
                    l.waits.advance(now, WaitReason::Batch);
                    let hit = l.lease.as_ref().map(|_| !l.missed);
                    self.metrics.waits.observe(hit, &l.waits);
                    let w = |r| l.waits.secs(r) * 1e3;
                    tracing::debug!(
                        target: LOG_TARGET,
                        seq = %o.seq,
                        adapter = l.lease.as_ref().map(|a| a.id().0),
                        adapter_bytes = l.lease.as_ref().and_then(|a| self.mem.bytes(a.id())),
                        hit,
                        prompt_tokens = l.prompt_len,
                        ttft_ms = ttft * 1e3,
                        batch_ms = w(WaitReason::Batch),
                        kv_ms = w(WaitReason::Kv),
                        disk_ms = w(WaitReason::Disk),
                        link_ms = w(WaitReason::Link),
                        held = l.cold.held,
                        layer_wait = l.cold.layer_wait,
                        "first token"
                    );
                    if let Some(log) = &mut self.step_log {
                        log.first(l.arrived, l.planned.unwrap_or(now), now, l.prompt_len);
                    }
                }
                Some(t) => self
                    .metrics
                    .tpot
                    .observe(now.duration_since(t).as_secs_f64()),
            }
            l.last_token = Some(now);
            l.generated += 1;
            if let Some(f) = o.finish {
                finished.push(o.seq);
                self.metrics
                    .e2e
                    .observe(now.duration_since(l.arrived).as_secs_f64());
                self.metrics.add_tokens(l.prompt_len, l.generated);
                self.metrics.count_finished(match f {
                    FinishReason::Stop(_) => "stop",
                    FinishReason::Length => "length",
                });
            }
            to_send.push((
                l.events.clone(),
                EngineEvent::Token {
                    token: o.token,
                    finish: o.finish,
                    prompt_logprobs: o.prompt_logprobs,
                    cached_tokens: std::mem::take(&mut l.cached_tokens),
                },
            ));
        }
        self.state.on_step(&planned, &sampled, &finished, &self.cfg);
        for id in &finished {
            if let Some(l) = self.live.get(id) {
                self.sched.finished(*id, l.generated);
            }
        }
        let any_finished = !finished.is_empty();
        for id in finished {
            // The engine already dropped the sequence; dropping `Live` releases the lease.
            self.live.remove(&id);
        }
        if any_finished && !self.limits.keep_idle {
            self.drop_idle();
        }
        // Book-keeping first, then the tokens: a client that saw its last token finds the
        // server's numbers (KV, leases, running) already updated.
        self.publish();
        for (tx, ev) in to_send {
            let _ = tx.send(ev);
        }
        true
    }

    /// Charges every unanswered request's time since the last step to what it waited for,
    /// and classifies what it waits for now (after this step's admission and memory plan).
    fn classify_waits(
        &mut self,
        admit: &crate::memory::AdmitPlan,
        plan: &thaw_runtime::engine::StepPlan,
    ) {
        let now = Instant::now();
        self.stepped.clear();
        self.stepped.extend(plan.items.iter().map(|i| i.seq));
        let head_waits_for_memory = admit.head.is_some_and(|h| h.memory);
        for (id, l) in self.live.iter_mut() {
            if l.last_token.is_some() {
                continue;
            }
            let reason = classify(&Moment {
                adapter: l.lease.as_ref().and_then(|a| self.mem.state(a.id())),
                admitted: l.running,
                stepped: self.stepped.contains(id),
                head_waits_for_memory,
            });
            l.waits.advance(now, reason);
        }
    }

    /// How long the requests admission could not place wait: its head's bound in steps, and
    /// each one's adapter load time (the scheduler's bypass rule weighs them).
    fn memory_wait(&self, plan: &crate::memory::AdmitPlan) -> MemoryWait {
        if self.sched.policy != SchedulingPolicy::Mlq {
            return MemoryWait::default();
        }
        let ok: HashSet<SeqId> = plan.admit.iter().copied().collect();
        MemoryWait {
            head: plan.head.as_ref().map(|h| (h.seq, h.bound_steps)),
            load_s: self
                .state
                .waiting
                .iter()
                .filter(|s| !ok.contains(&s.id))
                .filter_map(|s| Some((s.id, self.load_s(s.adapter?))))
                .collect(),
        }
    }

    /// The shape of a planned step for the performance model: decode and prefill rows and
    /// the ranks they carry.
    /// The step's shape, and Σ over its decode rows of the tokens already in their KV cache.
    fn step_shape(&self, plan: &thaw_runtime::engine::StepPlan) -> (StepShape, usize) {
        let mut shape = StepShape::default();
        let mut ctx = 0;
        for it in &plan.items {
            if let Some(s) = self.state.running.iter().find(|s| s.id == it.seq) {
                let decode = !s.in_prefill();
                shape.add(it.num_tokens, decode, self.sched.rank(it.seq));
                if decode {
                    ctx += s.computed;
                }
            }
        }
        (shape, ctx)
    }
}
