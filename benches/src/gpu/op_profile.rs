//! `thaw-bench gpu --op-profile` (issue 29): where a decode step's time goes, per op class.
//! After a decode row's timed steps, `--op-profile-steps` more steps run with every backend
//! op bracketed ([`Profiled`]: CUDA events on the compute stream, the wall clock on the CPU),
//! and the samples become one table per row: calls, µs, host µs issuing them, device time
//! between ops, % of the profiled step, and for the linears the weight bytes read and the
//! bandwidth achieved against the roofline.
use std::time::Instant;

use thaw_runtime::backend::any::AnyBackend;
use thaw_runtime::backend::op_profile::{aggregate, OpClass, OpProfile, OpSample, ProfileRow};
use thaw_runtime::backend::profiled::Profiled;
use thaw_runtime::engine::{Engine, StepPlan};
use thaw_runtime::model::ModelConfig;

use super::cases::Mix;

/// The raw samples of one decode row's profiled steps.
#[derive(Clone, Debug)]
pub struct OpProfileRun {
    pub batch: usize,
    pub mix: Mix,
    pub steps: usize,
    /// Mean wall time of a profiled step (timers included), µs.
    pub step_us: f64,
    /// Every op of every profiled step, in call order.
    pub samples: Vec<OpSample>,
    /// Bytes per weight element as the backend holds them.
    pub weight_elem: f64,
}

/// Runs one step of `plan` with every op timed: its wall µs (timers on) and its ops.
pub fn profile_step(
    engine: &mut Engine<Profiled<AnyBackend>>,
    plan: &StepPlan,
) -> anyhow::Result<(f64, Vec<OpSample>)> {
    engine.backend().start();
    let t0 = Instant::now();
    let r = engine.step(plan);
    let wall = t0.elapsed().as_secs_f64() * 1e6;
    // Read (and stop) the recording before any error propagates.
    let s = engine.backend().finish();
    r?;
    Ok((wall, s?))
}

/// Runs `steps` decode steps of `plan` with every op timed.
pub fn profile_steps(
    engine: &mut Engine<Profiled<AnyBackend>>,
    plan: &StepPlan,
    steps: usize,
) -> anyhow::Result<(f64, Vec<OpSample>)> {
    let mut samples = Vec::new();
    let mut wall = 0.0;
    for _ in 0..steps {
        let (us, s) = profile_step(engine, plan)?;
        wall += us;
        samples.extend(s);
    }
    Ok((wall / steps.max(1) as f64, samples))
}

/// Weight bytes one call of `class` reads: a module's projection or the LM head.
pub fn weight_bytes(c: &ModelConfig, weight_elem: f64, class: OpClass) -> Option<f64> {
    let elems = match class {
        OpClass::Linear(m) => {
            let (i, o) = c.module_shape(m);
            i * o
        }
        OpClass::LmHeadLogits | OpClass::LmHeadIds => c.vocab_size * c.hidden_size,
        _ => return None,
    };
    Some(elems as f64 * weight_elem)
}

impl OpProfileRun {
    pub fn profile(&self, c: &ModelConfig, peak_gbs: f64) -> OpProfile {
        let bytes = |class| weight_bytes(c, self.weight_elem, class);
        aggregate(&self.samples, self.steps, self.step_us, &bytes, peak_gbs)
    }
}

/// The tables of every profiled row.
pub fn table(runs: &[OpProfileRun], c: &ModelConfig, peak_gbs: f64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    for r in runs {
        let p = r.profile(c, peak_gbs);
        let _ = writeln!(
            s,
            "\n### Op profile: batch {}, adapters {}{} — {} profiled steps, {:.0} µs a step (wall, timers on); ops {:.0} µs, outside ops {:.0} µs",
            r.batch,
            r.mix.label(),
            r.mix.rank().map_or(String::new(), |k| format!(" (rank {k})")),
            r.steps,
            p.step_us,
            p.ops_us(),
            p.outside_us
        );
        let _ = writeln!(
            s,
            "host issue {:.0} µs a step; device time between ops (waiting for the host, and the timers' own events) {:.0} µs. An op whose host µs reach its µs, or a step with large gaps, is host-bound: its µs include launch gaps.",
            p.host_us(),
            p.gaps_us()
        );
        let _ = writeln!(
            s,
            "| op | calls/step | µs/step | host µs/step | gap before µs/step | % of step | weight MB/step | GB/s | % of roofline |\n|---|---|---|---|---|---|---|---|---|"
        );
        let linear: Vec<_> = p.rows.iter().filter(|r| r.bytes.is_some()).collect();
        let (lin_us, lin_bytes) = linear.iter().fold((0.0, 0.0), |(u, b), r| {
            (u + r.us, b + r.bytes.unwrap_or(0.0))
        });
        for row in &p.rows {
            let tail = [
                row.bytes.map_or("-".into(), |b| format!("{:.1}", b / 1e6)),
                row.gbs.map_or("-".into(), |g| format!("{g:.0}")),
                row.roofline_pct.map_or("-".into(), |x| format!("{x:.0}%")),
            ];
            let _ = writeln!(s, "{}", table_row(row, &tail));
        }
        let gbs = if lin_us > 0.0 {
            lin_bytes / lin_us / 1e3
        } else {
            0.0
        };
        let (lin_host, lin_gap) = linear
            .iter()
            .fold((0.0, 0.0), |(h, g), r| (h + r.host_us, g + r.gap_us));
        let _ = writeln!(
            s,
            "| all linears | - | {:.1} | {:.1} | {:.1} | {:.1}% | {:.1} | {:.0} | {:.0}% |",
            lin_us,
            lin_host,
            lin_gap,
            lin_us / p.step_us * 100.0,
            lin_bytes / 1e6,
            gbs,
            gbs / peak_gbs * 100.0
        );
        let _ = writeln!(s, "{}", outside_row(&p));
    }
    s
}

/// One op row of a profile table: the class, its calls, µs, host µs, gap µs and share of the
/// step, then the table's own `tail` columns.
pub fn table_row(row: &ProfileRow, tail: &[String]) -> String {
    format!(
        "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1}% | {} |",
        row.class.label(),
        row.calls,
        row.us,
        row.host_us,
        row.gap_us,
        row.share,
        tail.join(" | ")
    )
}

/// The row of the step time outside every op (a profile table of three tail columns).
pub fn outside_row(p: &OpProfile) -> String {
    format!(
        "| outside ops (host: plan, sample; idle device) | - | {:.1} | - | - | {:.1}% | - | - | - |",
        p.outside_us,
        p.outside_us / p.step_us * 100.0
    )
}

/// The checks of the quick run's profiles (`thaw-bench gpu --device cpu --quick --op-profile`,
/// run by the test suite): one profile per eager decode row, every op class the forward calls
/// with its exact calls per step, and the rows within the measured step.
#[cfg(test)]
pub(super) fn check_quick(r: &super::GpuReport) {
    use thaw_runtime::adapter::LoraModule;
    let c = &r.config;
    assert_eq!(
        r.op_profiles.len(),
        r.decode.len(),
        "one profile per eager row"
    );
    for (run, d) in r.op_profiles.iter().zip(&r.decode) {
        assert_eq!((run.batch, run.mix), (d.batch, d.mix));
        let p = run.profile(c, r.peaks.gbs);
        // With adapter rows the forward asks every module of every layer for its deltas (the
        // backend skips modules no adapter targets); without, none.
        let lora = if d.mix == Mix::Base {
            0.0
        } else {
            (LoraModule::ALL.len() * c.num_layers) as f64
        };
        check_calls(&p, c, lora);
        // The linears read their weights: q_proj's bytes are hidden × q_dim elements a layer.
        let q = p
            .rows
            .iter()
            .find(|row| row.class == OpClass::Linear(LoraModule::Q))
            .and_then(|row| row.bytes)
            .unwrap();
        let want = c.num_layers as f64 * (c.hidden_size * c.q_dim()) as f64 * run.weight_elem;
        assert!((q - want).abs() <= 1e-9 * want, "{q} vs {want}");
    }
    // One prefill profile per prefill length: the same forward over the prompt's rows, base
    // model (no adapter deltas).
    let tokens: Vec<usize> = r.prefill.iter().map(|f| f.tokens).collect();
    let profiled: Vec<usize> = r.prefill_op_profiles.iter().map(|p| p.tokens).collect();
    assert_eq!(profiled, tokens, "one prefill profile per prefill row");
    for run in &r.prefill_op_profiles {
        check_calls(&run.profile(), c, 0.0);
    }
    let t = super::table(&super::GpuArgs::quick_profiled(), r);
    assert_eq!(
        t.matches("### Op profile").count(),
        r.decode.len() + r.prefill.len()
    );
    super::prefill_profile::check_table(&t, r);
}

/// The calls per step of a quick run's profile (a decode step or a prefill: the same forward
/// over one or many rows): every op class the forward calls, `lora` adapter deltas, and every
/// row's figures finite.
#[cfg(test)]
fn check_calls(p: &OpProfile, c: &ModelConfig, lora: f64) {
    use thaw_runtime::adapter::LoraModule;
    let calls = |class: OpClass| {
        p.rows
            .iter()
            .find(|row| row.class == class)
            .map_or(0.0, |row| row.calls)
    };
    let layers = c.num_layers as f64;
    for m in LoraModule::ALL {
        assert_eq!(calls(OpClass::Linear(m)), layers, "{m:?}");
    }
    assert_eq!(calls(OpClass::Rope), 2.0 * layers);
    assert_eq!(calls(OpClass::Attention), layers);
    assert_eq!(calls(OpClass::Swiglu), layers);
    // Every layer's post-attention norm and every next layer's input norm; the first
    // input norm and the final norm stand alone; the last residual add too.
    assert_eq!(calls(OpClass::AddRmsNorm), 2.0 * layers - 1.0);
    assert_eq!(calls(OpClass::RmsNorm), 2.0);
    assert_eq!(calls(OpClass::ResidualAdd), 1.0);
    assert_eq!(calls(OpClass::Embed), 1.0);
    assert_eq!(calls(OpClass::Gather), 1.0);
    // The bench's rows are greedy without logprobs: the step brings back token ids
    // (`Backend::greedy_ids`), not logits.
    assert_eq!(calls(OpClass::LmHeadIds), 1.0);
    assert_eq!(calls(OpClass::LmHeadLogits), 0.0);
    assert_eq!(calls(OpClass::Lora), lora);
    // The op timers nest inside the step's (one monotonic clock on the CPU): the rows
    // never sum past the step, and the time outside every op (planning, sampling, the
    // wrapper's own timers) stays under half of it.
    assert!(p.ops_us() <= p.step_us * (1.0 + 1e-9), "{p:?}");
    assert!(
        p.ops_us() >= 0.5 * p.step_us,
        "ops {} of {} µs",
        p.ops_us(),
        p.step_us
    );
    for row in &p.rows {
        assert!(row.us.is_finite() && row.us >= 0.0, "{row:?}");
        // One wall clock on the CPU: issuing an op takes no longer than the op.
        assert!(
            row.host_us >= 0.0 && row.host_us <= row.us + 1e-3,
            "{row:?}"
        );
        assert!(row.gap_us.is_finite() && row.gap_us >= 0.0, "{row:?}");
        if let Some(g) = row.gbs {
            assert!(g.is_finite() && g > 0.0, "{row:?}");
        }
    }
}
