//! An engine-level driver for cold-start experiments: requests arrive on a clock, adapters
//! move disk → host (loader thread) → device (copy engine), and a FIFO continuous-batching
//! loop applies a [`ColdStartPolicy`] to requests whose adapter is not resident.
//!
//! The HTTP server's scheduler applies the same policy decisions: each step the driver asks the
//! server's gate ([`super::layer_gate::policy_gate`], with the layer gate where the policy
//! waits for the copy) for every prefilling request whose adapter has not landed, and marks
//! the adapters of the requests it starts wait or assist as the server does
//! ([`super::layer_gate::carry_out`]). It exists so the policies can be compared and tested on
//! the engine alone, with real wall-clock timing.
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::Backend as _;
use thaw_runtime::engine::{
    AssistProfile, Engine, FinishReason, PlanItem, SequenceParams, StepPlan, UnlandedLayers,
};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;

use super::cost::{AssistWork, CostModel, Prediction};
use super::decide::{ColdCase, ColdTier};
use super::layer_gate::{carry_out, in_step, policy_gate, unlanded_layers, Answer};
use super::layer_gate::{ColdGate, InFlight};
use super::policy::ColdStartPolicy;
use crate::memory::loader::{FetchJob, FetchResult, Loader};
use crate::perf::DiskQueue;

/// Where an adapter starts a run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StartTier {
    /// Resident on the device.
    Device,
    /// In host memory, streaming to the device from the start of the run.
    Streaming,
    /// In host memory (and the workers' host store); streamed to the device when its first
    /// request arrives — CaraServe's setting, where a cold start is the host → device copy.
    Host,
    /// On disk: loaded when its first request arrives.
    Disk,
}

/// One request of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Arrival, from the start of the run.
    pub arrival: Duration,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Index into the run's adapters, or None for the base model.
    pub adapter: Option<usize>,
    pub sampling: SamplingParams,
}

/// What happened to one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub ttft: Option<Duration>,
    pub e2e: Option<Duration>,
    pub finish: Option<FinishReason>,
    /// Why the request failed (its adapter could not be loaded), if it did.
    pub error: Option<String>,
    /// From arrival until the adapter was in the host tier (registered with the engine).
    pub host_ready: Option<Duration>,
    /// From arrival until its first prefill chunk was planned.
    pub started: Option<Duration>,
    /// Whether its adapter was not on the device when it arrived (a cold start).
    pub missed: bool,
    /// From arrival until every layer of its adapter was on the device.
    pub landed: Option<Duration>,
    /// It ran in a step that waited in the forward for its adapter's layers not landed (the
    /// server's `thaw_cold_start_layer_waits_total`).
    pub layer_wait: bool,
    /// The gate held it for its adapter's copy for at least one step (the server's
    /// `thaw_cold_start_holds_total`).
    pub held: bool,
}

impl Outcome {
    /// What a miss waited for before its first token: (disk, batch, copy). Disk: until its
    /// adapter was in the host tier (read, or mapped from its file); copy: then until its
    /// adapter landed or its prefill started, whichever came first; batch: the rest (a place
    /// in the batch, and computing its prompt) — the reasons of `thaw_request_wait_seconds`.
    pub fn waits(&self) -> Option<(Duration, Duration, Duration)> {
        let ttft = self.ttft?;
        let disk = self.host_ready.unwrap_or(ttft).min(ttft);
        let go = match (self.started, self.landed) {
            (Some(s), Some(l)) => s.min(l),
            (s, l) => s.or(l).unwrap_or(ttft),
        };
        let copy = go.min(ttft).saturating_sub(disk);
        Some((disk, ttft - disk - copy, copy))
    }

    /// Time per output token after the first.
    pub fn tpot(&self) -> Option<Duration> {
        let (t, e) = (self.ttft?, self.e2e?);
        (self.tokens.len() > 1).then(|| (e - t) / (self.tokens.len() as u32 - 1))
    }
}

/// Driver knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct DriverConfig {
    pub policy: ColdStartPolicy,
    /// Largest prefill chunk per request per step.
    pub max_chunk: usize,
    /// Token budget of a step.
    pub max_batch_tokens: usize,
    /// Disk → host loader threads (`thaw serve` uses
    /// [`crate::memory::loader::default_threads`]).
    pub loader_threads: usize,
}

/// Everything a run produced.
#[derive(Clone, Debug, Default)]
pub struct RunReport {
    pub outcomes: Vec<Outcome>,
    /// `auto`'s TTFT predictions next to what happened.
    pub predictions: Vec<Prediction>,
    /// Row·modules the CPU computed.
    pub rows_assisted: u64,
    pub wall: Duration,
    /// Every engine step of the run, in order.
    pub steps: Vec<StepRecord>,
    /// Where the run's CPU-assisted steps spent the engine thread's time.
    pub assist: AssistProfile,
    /// Adapters registered from their memory-mapped files (disk misses read layer by layer).
    pub disk_maps: u64,
}

/// One engine step: what it carried and how long it took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepRecord {
    pub tokens: usize,
    /// Sequences in decode (one token each).
    pub decodes: usize,
    /// Whether a row's adapter had layers not yet on the device.
    pub cold: bool,
    /// Whether the CPU computed some of its rows (a cold step's layers not landed, assisted).
    pub assisted: bool,
    /// Time the forward waited for layers to land (a cold step's layers not landed, waited
    /// for: the server's gate lets this cost at most a small share of the step).
    pub layer_wait: Duration,
    pub elapsed: Duration,
    /// Engine-thread time the step spent on the assist path (see [`AssistProfile::overhead`]).
    pub assist_overhead: Duration,
}

#[derive(Clone, Debug)]
enum AdapterState {
    Disk,
    Loading,
    /// Loaded into host memory; registered (and streamed) on its first request.
    Host,
    Ready,
    Failed(String),
}

struct Live {
    req: usize,
    admitted: bool,
}

/// Runs `requests` (sorted by arrival) to completion on `engine`. Sets the engine's default
/// for layers not landed to the policy's, as the server does
/// ([`super::layer_gate::unlanded_layers`]).
pub fn run(
    engine: &mut Engine<CpuBackend>,
    adapters: &[(PathBuf, StartTier)],
    requests: &[Request],
    cfg: &DriverConfig,
    cost: &mut CostModel,
) -> RunReport {
    // The server's loader, without its re-read checks (a first read has no size to compare
    // with) or a dtype conversion; its results come back on a channel polled between steps.
    let (done_tx, done_rx) = crossbeam::channel::unbounded::<(AdapterId, FetchResult)>();
    let loader = Loader::start(
        engine.model_config().clone(),
        cfg.loader_threads,
        None,
        move |id, r| {
            let _ = done_tx.send((id, r));
        },
    )
    .expect("starting the adapter loader threads");
    engine.set_unlanded_layers(unlanded_layers(cfg.policy));
    let mut state: Vec<AdapterState> = vec![AdapterState::Disk; adapters.len()];
    let mut host: Vec<Option<Arc<LoraAdapter>>> = vec![None; adapters.len()];
    // Initial tiers (the cached oracle makes everything resident up front).
    for (i, (dir, tier)) in adapters.iter().enumerate() {
        let tier = if cfg.policy == ColdStartPolicy::Cached {
            StartTier::Device
        } else {
            *tier
        };
        if tier == StartTier::Disk {
            continue;
        }
        // Read as the server's loader reads it: in place (the page cache's pages, no heap copy).
        match LoraAdapter::load_host(dir, engine.model_config(), None) {
            Ok(a) => {
                let a = Arc::new(a);
                let id = AdapterId(i as u32);
                let r = match tier {
                    StartTier::Device => engine.register_adapter(id, a.clone()),
                    StartTier::Streaming => engine.register_adapter_streaming(id, a.clone()),
                    // In the host tier: its device image is written into the upload arena.
                    StartTier::Host => {
                        engine.stage_adapter(&a);
                        Ok(())
                    }
                    StartTier::Disk => Ok(()),
                };
                state[i] = match r {
                    Ok(()) if tier == StartTier::Host => AdapterState::Host,
                    Ok(()) => AdapterState::Ready,
                    Err(e) => AdapterState::Failed(e.to_string()),
                };
                host[i] = Some(a);
            }
            Err(e) => state[i] = AdapterState::Failed(e.to_string()),
        }
    }
    // The host tier is warm when the run starts: its adapters' images are in the arena.
    let t0 = Instant::now();
    while engine.backend().upload_arena().is_some_and(|u| !u.idle)
        && t0.elapsed() < Duration::from_secs(300)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let rows_before = engine.rows_assisted();
    let assist_before = engine.assist_profile();
    let mut steps = Vec::new();
    let mut out = vec![Outcome::default(); requests.len()];
    let mut predicted: Vec<Option<f64>> = vec![None; requests.len()];
    // A disk adapter's load starts when its first request arrives, not when the engine
    // next looks between steps (the HTTP server loads on its own threads too).
    let first_loads: Vec<(Duration, usize)> = {
        let mut seen = vec![false; adapters.len()];
        requests
            .iter()
            .filter_map(|r| {
                let a = r.adapter?;
                let disk = matches!(state[a], AdapterState::Disk);
                (disk && !std::mem::replace(&mut seen[a], true)).then_some((r.arrival, a))
            })
            .collect()
    };
    // As the server chooses ([`ColdStartPolicy::serves_disk_miss_from_file`]), a disk-tier
    // adapter is registered from its mapped file when its first request arrives: the upload
    // pipeline reads it layer by layer (and the workers, if any, compute its layers from the
    // file) while the loader reads it whole; the loader's full load then validates it and
    // replaces the mapped host copy. (`cached` has no disk tier here: the oracle makes every
    // adapter resident up front.)
    let from_file = cfg.policy.serves_disk_miss_from_file();
    let requester = &loader;
    let mut disk_maps = 0u64;
    // When each adapter had every layer on the device, from the start of the run.
    let mut landed_at: Vec<Option<Duration>> = (0..adapters.len())
        .map(|i| {
            engine
                .adapter_resident(AdapterId(i as u32))
                .then_some(Duration::ZERO)
        })
        .collect();
    let start = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            for (at, a) in first_loads {
                if let Some(wait) = at.checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
                requester.fetch(FetchJob {
                    id: AdapterId(a as u32),
                    path: adapters[a].0.clone(),
                    root: None,
                    bytes: None,
                });
            }
        });
        let mut queue: VecDeque<Live> = VecDeque::new();
        let mut next = 0;
        let mut done = 0;
        while done < requests.len() {
            let now = start.elapsed();
            // Arrivals; a host-tier adapter's first request starts its copy to the device.
            while next < requests.len() && requests[next].arrival <= now {
                if let Some(a) = requests[next].adapter {
                    out[next].missed = landed_at[a].is_none();
                    match state[a] {
                        AdapterState::Disk if from_file => {
                            state[a] = match register_mapped(engine, a, &adapters[a].0) {
                                Ok(ad) => {
                                    disk_maps += 1;
                                    host[a] = Some(ad);
                                    AdapterState::Ready
                                }
                                // The loader (queued already) reports what is wrong.
                                Err(_) => AdapterState::Loading,
                            };
                        }
                        AdapterState::Disk => state[a] = AdapterState::Loading, // queued already
                        AdapterState::Host => {
                            let ad = host[a].clone().expect("host-tier adapters are loaded");
                            state[a] =
                                match engine.register_adapter_streaming(AdapterId(a as u32), ad) {
                                    Ok(()) => AdapterState::Ready,
                                    Err(e) => AdapterState::Failed(e.to_string()),
                                };
                        }
                        _ => {}
                    }
                }
                queue.push_back(Live {
                    req: next,
                    admitted: false,
                });
                next += 1;
            }
            for (id, r) in done_rx.try_iter() {
                let (a, r) = (id.0 as usize, r.map(|(ad, _)| ad));
                if matches!(state[a], AdapterState::Ready) && engine.adapter_is_mapped(id) {
                    // Served from its file since its request arrived: the full load is the
                    // validation (finite weights) and becomes the engine's host copy.
                    state[a] = match r.and_then(|ad| {
                        engine
                            .adopt_host_copy(id, ad.clone())
                            .map_err(|e| e.to_string())?;
                        host[a] = Some(ad);
                        Ok(())
                    }) {
                        Ok(()) => AdapterState::Ready,
                        Err(e) => AdapterState::Failed(e),
                    };
                    continue;
                }
                state[a] = match r.and_then(|ad| {
                    engine
                        .register_adapter_streaming(AdapterId(a as u32), ad.clone())
                        .map_err(|e| e.to_string())?;
                    host[a] = Some(ad);
                    Ok(())
                }) {
                    Ok(()) => AdapterState::Ready,
                    Err(e) => AdapterState::Failed(e),
                };
            }
            for (a, t) in landed_at.iter_mut().enumerate() {
                if t.is_none()
                    && matches!(state[a], AdapterState::Ready)
                    && engine.adapter_resident(AdapterId(a as u32))
                {
                    *t = Some(now);
                }
            }
            for l in queue.iter() {
                let r = &requests[l.req];
                let ready = r
                    .adapter
                    .is_none_or(|a| matches!(state[a], AdapterState::Ready));
                if ready && out[l.req].host_ready.is_none() {
                    out[l.req].host_ready = Some(now.max(r.arrival) - r.arrival);
                }
            }
            // Requests of a failed adapter fail alone.
            queue.retain(|l| {
                let r = &requests[l.req];
                match r.adapter.map(|a| &state[a]) {
                    Some(AdapterState::Failed(e)) => {
                        if l.admitted {
                            let _ = engine.remove_sequence(SeqId(l.req as u64));
                        }
                        out[l.req].error = Some(e.clone());
                        done += 1;
                        false
                    }
                    _ => true,
                }
            });
            let mut failed = Vec::new();
            let mut answers = Vec::new();
            let plan = build_plan(
                engine,
                requests,
                &mut queue,
                (&state, &host),
                &out,
                cfg,
                cost,
                &mut predicted,
                (&mut failed, &mut answers),
            );
            // The gate's answers, carried out as the server's step loop does.
            let (marks, held) = carry_out(&answers, |s| plan.items.iter().any(|i| i.seq == s));
            for (seq, adapter, u) in marks {
                // A registered adapter (the gate saw it): a failure would fail the step.
                let _ = engine.set_adapter_unlanded(adapter, u);
                if u == UnlandedLayers::Wait {
                    out[seq.0 as usize].layer_wait = true;
                }
            }
            for seq in held {
                out[seq.0 as usize].held = true;
            }
            for (i, e) in failed {
                out[i].error = Some(e);
                queue.retain(|l| l.req != i);
                done += 1;
            }
            if plan.items.is_empty() {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            let tokens: usize = plan.items.iter().map(|i| i.num_tokens).sum();
            let planned_at = start.elapsed();
            for it in &plan.items {
                let i = it.seq.0 as usize;
                if out[i].started.is_none() {
                    out[i].started = Some(planned_at.saturating_sub(requests[i].arrival));
                }
            }
            let cold = plan.items.iter().any(|i| {
                requests[i.seq.0 as usize]
                    .adapter
                    .is_some_and(|a| !engine.adapter_resident(AdapterId(a as u32)))
            });
            let profile_before = engine.assist_profile();
            let (rows_before, wait_before) = (engine.rows_assisted(), engine.layer_wait());
            let t = Instant::now();
            let outputs = match engine.step(&plan) {
                Ok(o) => o,
                Err(e) => {
                    // A failed step fails the requests in it, not the run.
                    for it in &plan.items {
                        let i = it.seq.0 as usize;
                        let _ = engine.remove_sequence(it.seq);
                        out[i].error = Some(e.to_string());
                        queue.retain(|l| l.req != i);
                        done += 1;
                    }
                    continue;
                }
            };
            let elapsed = t.elapsed();
            let overhead = engine.assist_profile().since(&profile_before).overhead();
            let assisted = engine.rows_assisted() > rows_before;
            let layer_wait = engine.layer_wait().saturating_sub(wait_before);
            // The device's time: without what the forward waited for the link.
            let computing = elapsed.saturating_sub(layer_wait);
            if assisted {
                cost.observe_assisted_step(tokens, computing, overhead);
            } else {
                cost.observe_step(tokens, computing);
            }
            steps.push(StepRecord {
                tokens,
                decodes: plan.items.iter().filter(|i| i.num_tokens == 1).count(),
                cold,
                assisted,
                layer_wait,
                elapsed,
                assist_overhead: overhead,
            });
            let now = start.elapsed();
            for o in outputs {
                let i = o.seq.0 as usize;
                let r = &requests[i];
                let oc = &mut out[i];
                if oc.ttft.is_none() {
                    oc.ttft = Some(now.saturating_sub(r.arrival));
                }
                oc.tokens.push(o.token.id);
                if let Some(f) = o.finish {
                    oc.finish = Some(f);
                    oc.e2e = Some(now.saturating_sub(r.arrival));
                    queue.retain(|l| l.req != i);
                    done += 1;
                }
            }
        }
    });
    for (o, r) in out.iter_mut().zip(requests) {
        if let Some(t) = r.adapter.and_then(|a| landed_at[a]) {
            o.landed = Some(t.saturating_sub(r.arrival));
        }
    }
    let predictions = predicted
        .iter()
        .zip(&out)
        .filter_map(|(p, o)| {
            Some(Prediction {
                predicted_s: (*p)?,
                actual_s: o.ttft?.as_secs_f64(),
            })
        })
        .collect();
    RunReport {
        outcomes: out,
        predictions,
        rows_assisted: engine.rows_assisted() - rows_before,
        wall: start.elapsed(),
        steps,
        assist: engine.assist_profile().since(&assist_before),
        disk_maps,
    }
}

/// Maps adapter `a`'s file and registers it streaming, its host-store entry naming the file.
fn register_mapped(
    engine: &mut Engine<CpuBackend>,
    a: usize,
    dir: &std::path::Path,
) -> Result<Arc<LoraAdapter>, String> {
    let ad = Arc::new(LoraAdapter::map(dir, engine.model_config()).map_err(|e| e.to_string())?);
    engine
        .register_adapter_streaming(AdapterId(a as u32), ad.clone())
        .map_err(|e| e.to_string())?;
    Ok(ad)
}

/// FIFO with a token budget: every decode first, then prefill chunks in arrival order; a
/// request whose adapter is not resident waits or runs per the policy, asked again every step
/// (an assist stops the step `auto`'s decision flips, and never runs a chunk above it).
#[allow(clippy::too_many_arguments)]
fn build_plan(
    engine: &mut Engine<CpuBackend>,
    requests: &[Request],
    queue: &mut VecDeque<Live>,
    (state, host): (&[AdapterState], &[Option<Arc<LoraAdapter>>]),
    out: &[Outcome],
    cfg: &DriverConfig,
    cost: &CostModel,
    predicted: &mut [Option<f64>],
    (failed, answers): (&mut Vec<(usize, String)>, &mut Vec<Answer>),
) -> StepPlan {
    let mut items = Vec::new();
    let mut budget = cfg.max_batch_tokens;
    // Decodes (admitted, one pending token).
    for l in queue.iter() {
        let seq = SeqId(l.req as u64);
        if l.admitted && engine.pending_tokens(seq).ok() == Some(1) && budget > 0 {
            items.push(PlanItem { seq, num_tokens: 1 });
            budget -= 1;
        }
    }
    let decode_tokens = items.len();
    // The decoding requests' fewest output tokens left: what an assist's stretch is spread
    // over (`ColdCase::fewest_left`).
    let fewest_left = items
        .iter()
        .map(|it| {
            let i = it.seq.0 as usize;
            requests[i].max_tokens.saturating_sub(out[i].tokens.len())
        })
        .min()
        .unwrap_or(usize::MAX);
    for l in queue.iter_mut() {
        if budget == 0 {
            break;
        }
        let r = &requests[l.req];
        let seq = SeqId(l.req as u64);
        let pending = if l.admitted {
            engine.pending_tokens(seq).unwrap_or(0)
        } else {
            r.prompt.len()
        };
        if pending <= 1 && l.admitted {
            continue; // decoding, already planned
        }
        let mut cap = cfg.max_chunk.min(budget);
        if let Some(a) = r.adapter {
            if !matches!(state[a], AdapterState::Ready) {
                continue; // still on disk or loading: the host tier is needed first
            }
            let id = AdapterId(a as u32);
            let unlanded = engine.adapter_landed(id).filter(|&(l, n)| l < n);
            if let Some((landed, layers)) = unlanded {
                let adapter = host[a].as_ref().expect("ready adapters have a host copy");
                let bytes = adapter.size_bytes() as u64;
                let backlog = engine.backend().link_backlog();
                let from_file = engine.adapter_is_mapped(id);
                let planned = cfg.max_batch_tokens - budget;
                let mut assist_s = None;
                let decide = || {
                    let plan = cost.decide_cold(&ColdCase {
                        tier: ColdTier::registered(landed, layers, from_file),
                        bytes,
                        backlog,
                        // Served from its mapped file: the copy reads the file itself.
                        reads: DiskQueue::default(),
                        work: AssistWork::of(adapter),
                        prompt_left: pending,
                        cap,
                        other_tokens: planned,
                        running: decode_tokens,
                        fewest_left,
                        max_new_tokens: r.max_tokens,
                    });
                    assist_s = plan.assist_s;
                    plan.decision
                };
                // The server's layer gate: this step's rows so far and this request's chunk.
                let layers_gate = || {
                    let a = InFlight::of(bytes, (landed, layers), backlog, from_file);
                    in_step(cost, a, planned + pending.min(cap))
                };
                let g = policy_gate(cfg.policy, decide, layers_gate);
                answers.push((seq, id, g));
                match g {
                    ColdGate::Hold => continue,
                    ColdGate::Run { cap: Some(c), .. } => {
                        if predicted[l.req].is_none() {
                            predicted[l.req] = assist_s;
                        }
                        cap = cap.min(c);
                    }
                    ColdGate::Run { cap: None, .. } | ColdGate::Warm => {}
                }
            }
        }
        if !l.admitted {
            let params = SequenceParams {
                prompt: r.prompt.clone(),
                adapter: r.adapter.map(|a| AdapterId(a as u32)),
                sampling: r.sampling.clone(),
                max_new_tokens: r.max_tokens,
                ignore_eos: true,
                ..Default::default()
            };
            if let Err(e) = engine.add_sequence(seq, params) {
                failed.push((l.req, e.to_string()));
                continue;
            }
            l.admitted = true;
        }
        let n = pending.min(cap);
        if n == 0 {
            continue;
        }
        items.push(PlanItem { seq, num_tokens: n });
        budget -= n;
    }
    StepPlan {
        items,
        return_logits: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Option<Duration> {
        Some(Duration::from_millis(v))
    }

    /// A miss's waits add up to its TTFT: the read, the copy until it landed or started (an
    /// assisted prefill starts before it lands), and the rest in the batch.
    #[test]
    fn a_miss_waits_split_into_disk_batch_and_copy() {
        let waited = Outcome {
            ttft: ms(100),
            host_ready: ms(20),
            landed: ms(50),
            started: ms(70),
            ..Default::default()
        };
        assert_eq!(
            waited.waits(),
            Some((ms(20).unwrap(), ms(50).unwrap(), ms(30).unwrap()))
        );
        let assisted = Outcome {
            started: ms(21),
            ..waited.clone()
        };
        assert_eq!(
            assisted.waits(),
            Some((ms(20).unwrap(), ms(79).unwrap(), ms(1).unwrap()))
        );
        // No first token: no split; neither a landing nor a start recorded: the copy, all of
        // it.
        assert_eq!(Outcome::default().waits(), None);
        let bare = Outcome {
            ttft: ms(5),
            host_ready: ms(0),
            ..Default::default()
        };
        assert_eq!(
            bare.waits(),
            Some((Duration::ZERO, Duration::ZERO, ms(5).unwrap()))
        );
    }
}
