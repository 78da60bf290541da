//! `thaw-bench gpu --op-profile` for prefill (issue 29): where the time of one sequence's
//! prefill of `--prefill-tokens` tokens goes, per op class. The samples come from the same
//! [`Profiled`](thaw_runtime::backend::profiled::Profiled) wrapper and the same
//! [`aggregate`] as the decode profile ([`super::op_profile`]); what differs is the work a call
//! does: a prefill's linears and attention are products of `tokens` rows, so their figure is
//! TFLOP/s against the GEMM roofline (`--peak-tflops` or the bench's measured `linear`), and the
//! elementwise ops' is the activation bytes they read and write, GB/s against the bandwidth
//! roofline.
use std::fmt::Write;

use thaw_runtime::backend::op_profile::{aggregate, OpClass, OpProfile, OpSample};
use thaw_runtime::model::ModelConfig;

use super::op_profile::{outside_row, table_row};
use super::peaks::Peaks;
use super::roofline::prefill_attention_flops;

/// The raw samples of one prefill length's profiled steps.
#[derive(Clone, Debug)]
pub struct PrefillOpRun {
    /// Prompt tokens of the one sequence.
    pub tokens: usize,
    /// Profiled prefills (each a fresh sequence).
    pub steps: usize,
    /// Mean wall time of a profiled prefill step (timers included), µs.
    pub step_us: f64,
    /// Every op of every profiled step, in call order.
    pub samples: Vec<OpSample>,
    /// Bytes per activation element (the KV cache's element: bf16 on CUDA, f32 on the CPU).
    pub act_elem: f64,
}

/// What one call of an op class does in a prefill of `tokens` tokens.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Work {
    /// Floating-point operations (products: the linears, attention, the LM head's one row).
    Flops(f64),
    /// Activation bytes read and written (the elementwise ops).
    Bytes(f64),
}

/// The work of one call of `class` in a one-sequence prefill of `t` tokens, activations of
/// `act` bytes an element; None for classes a base-model prefill has no figure for.
pub fn prefill_work(c: &ModelConfig, t: usize, act: f64, class: OpClass) -> Option<Work> {
    let (t_f, h) = (t as f64, c.hidden_size as f64);
    let rows = |elems_per_token: f64| Work::Bytes(t_f * elems_per_token * act);
    Some(match class {
        OpClass::Linear(m) => {
            let (i, o) = c.module_shape(m);
            Work::Flops(2.0 * t_f * (i * o) as f64)
        }
        // The step samples one row: the LM head is a product of one row.
        OpClass::LmHeadIds | OpClass::LmHeadLogits => {
            Work::Flops(2.0 * (c.vocab_size * c.hidden_size) as f64)
        }
        OpClass::Attention => Work::Flops(prefill_attention_flops(c, t)),
        // Embedding rows read, hidden states written.
        OpClass::Embed => rows(2.0 * h),
        // x read, normed x written.
        OpClass::RmsNorm => rows(2.0 * h),
        // x and the residual read, the residual and normed x written.
        OpClass::AddRmsNorm => rows(4.0 * h),
        OpClass::ResidualAdd => rows(3.0 * h),
        // q and k read and written.
        OpClass::Rope => rows(2.0 * (c.q_dim() + c.kv_dim()) as f64),
        // gate and up read, their product written.
        OpClass::Swiglu => rows(3.0 * c.intermediate_size as f64),
        // The gate and up products (their FLOPs dominate the fused op's time).
        OpClass::GatedMlp => {
            let (i, o) = c.module_shape(thaw_runtime::adapter::LoraModule::Gate);
            Work::Flops(2.0 * 2.0 * t_f * (i * o) as f64)
        }
        // The q/k/v products and attention (their FLOPs dominate the fused op's time).
        OpClass::QkvAttention => {
            let (i, o) = (c.hidden_size, c.q_dim() + 2 * c.kv_dim());
            Work::Flops(2.0 * t_f * (i * o) as f64 + prefill_attention_flops(c, t))
        }
        // The last row read and written.
        OpClass::Gather => Work::Bytes(2.0 * h * act),
        OpClass::LinearOther | OpClass::Lora | OpClass::Assist => return None,
    })
}

impl PrefillOpRun {
    /// The rows (calls, µs, shares) of the profile; the work columns are [`table`]'s.
    pub fn profile(&self) -> OpProfile {
        aggregate(&self.samples, self.steps, self.step_us, &|_| None, 0.0)
    }
}

/// `work` done in `us` µs as the table's cells: work per step, rate, % of its roofline.
fn cells(work: Work, us: f64, peaks: &Peaks) -> [String; 3] {
    let (amount, rate, unit, peak) = match work {
        // FLOP / µs / 1e6 = TFLOP/s; bytes / µs / 1e3 = GB/s.
        Work::Flops(f) => (
            format!("{} GFLOP", sig(f / 1e9)),
            f / us / 1e6,
            "TFLOP/s",
            peaks.tflops,
        ),
        Work::Bytes(b) => (
            format!("{} MB", sig(b / 1e6)),
            b / us / 1e3,
            "GB/s",
            peaks.gbs,
        ),
    };
    if us <= 0.0 {
        return [amount, "-".into(), "-".into()];
    }
    [
        amount,
        format!("{} {unit}", sig(rate)),
        format!("{:.0}%", rate / peak * 100.0),
    ]
}

/// `x` with at least three significant digits (and one decimal at most past them for large
/// values): a tiny model's work on the CPU and a 7B model's on a GPU in the same columns.
fn sig(x: f64) -> String {
    let decimals = if x > 0.0 {
        (2.0 - x.log10().floor()).clamp(1.0, 9.0) as usize
    } else {
        1
    };
    format!("{x:.decimals$}")
}

/// The tables of every profiled prefill length.
pub fn table(runs: &[PrefillOpRun], c: &ModelConfig, peaks: &Peaks) -> String {
    let mut s = String::new();
    for r in runs {
        let p = r.profile();
        let _ = writeln!(
            s,
            "\n### Op profile: prefill of {} tokens, one sequence, base model — {} profiled prefills, {:.0} µs a step (wall, timers on); ops {:.0} µs, outside ops {:.0} µs",
            r.tokens,
            r.steps,
            p.step_us,
            p.ops_us(),
            p.outside_us
        );
        let _ = writeln!(
            s,
            "host issue {:.0} µs a step; device time between ops {:.0} µs. Linears, attention (causal: t(t+1)/2 pairs) and the LM head (one row): TFLOP/s against {} TFLOP/s; elementwise ops: activation bytes read + written, GB/s against {:.0} GB/s.",
            p.host_us(),
            p.gaps_us(),
            sig(peaks.tflops),
            peaks.gbs
        );
        let _ = writeln!(
            s,
            "| op | calls/step | µs/step | host µs/step | gap before µs/step | % of step | work/step | rate | % of roofline |\n|---|---|---|---|---|---|---|---|---|"
        );
        let mut lin = (0.0, 0.0);
        for row in &p.rows {
            let work = prefill_work(c, r.tokens, r.act_elem, row.class).map(|w| match w {
                Work::Flops(f) => Work::Flops(f * row.calls),
                Work::Bytes(b) => Work::Bytes(b * row.calls),
            });
            if let (OpClass::Linear(_), Some(Work::Flops(f))) = (row.class, work) {
                lin = (lin.0 + row.us, lin.1 + f);
            }
            let tail = work.map_or(["-".into(), "-".into(), "-".into()], |w| {
                cells(w, row.us, peaks)
            });
            let _ = writeln!(s, "{}", table_row(row, &tail));
        }
        let [amount, rate, pct] = cells(Work::Flops(lin.1), lin.0, peaks);
        let _ = writeln!(
            s,
            "| all linears (in the rows above) | - | {:.1} | - | - | ({:.1}%) | {amount} | {rate} | {pct} |",
            lin.0,
            lin.0 / p.step_us * 100.0
        );
        let _ = writeln!(s, "{}", outside_row(&p));
    }
    s
}

/// The checks of the quick run's printed prefill profiles (run by the test suite, see
/// `op_profile::check_quick`): per prefill length one table with a row for every op class a
/// base-model prefill calls, each product's rate in TFLOP/s and each elementwise op's in GB/s;
/// the printed `% of step` column (the op rows and the outside row) sums to 100% within the
/// rounding of its one-decimal cells (0.05 a row); and the FLOPs of the rows are the prefill's
/// (`roofline::prefill_flops`, the figure the prefill table divides by).
#[cfg(test)]
pub(super) fn check_table(t: &str, r: &super::GpuReport) {
    use thaw_runtime::adapter::LoraModule;
    let c = &r.config;
    for run in &r.prefill_op_profiles {
        let header = format!("### Op profile: prefill of {} tokens", run.tokens);
        let rows: Vec<Vec<&str>> = t
            .split(&header)
            .nth(1)
            .unwrap_or_else(|| panic!("no {header} table"))
            .lines()
            .skip(4)
            .take_while(|l| l.starts_with("| "))
            .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
            .collect();
        let mut classes = vec![
            OpClass::Embed,
            OpClass::RmsNorm,
            OpClass::AddRmsNorm,
            OpClass::Rope,
            OpClass::Attention,
            OpClass::Swiglu,
            OpClass::ResidualAdd,
            OpClass::Gather,
            OpClass::LmHeadIds,
        ];
        classes.extend(LoraModule::ALL.map(OpClass::Linear));
        for class in classes {
            let row = rows
                .iter()
                .find(|row| row[0] == class.label())
                .unwrap_or_else(|| panic!("no {} row in {header}: {rows:?}", class.label()));
            let unit = match class {
                OpClass::Linear(_) | OpClass::Attention | OpClass::LmHeadIds => " TFLOP/s",
                _ => " GB/s",
            };
            let rate: f64 = row[7]
                .strip_suffix(unit)
                .unwrap_or_else(|| panic!("{row:?} not in{unit}"))
                .parse()
                .unwrap();
            assert!(rate.is_finite() && rate >= 0.0, "{row:?}");
        }
        // The op rows and the outside row, not the "all linears" sum (in parentheses).
        let shares: Vec<f64> = rows
            .iter()
            .filter_map(|row| row[5].strip_suffix('%'))
            .filter(|x| !x.starts_with('('))
            .map(|x| x.parse::<f64>().unwrap())
            .collect();
        assert_eq!(shares.len(), rows.len() - 1, "{rows:?}");
        let sum: f64 = shares.iter().sum();
        let tol = 0.05 * shares.len() as f64 + 1e-6;
        assert!((sum - 100.0).abs() <= tol, "{header}: {sum}% (±{tol})");
        // Products' FLOPs per step: the linears, attention and the one row of logits.
        let flops: f64 = run
            .profile()
            .rows
            .iter()
            .filter_map(
                |row| match prefill_work(c, run.tokens, run.act_elem, row.class) {
                    Some(Work::Flops(f)) => Some(f * row.calls),
                    _ => None,
                },
            )
            .sum();
        let want = super::roofline::prefill_flops(c, run.tokens);
        assert!((flops - want).abs() <= 1e-9 * want, "{flops} vs {want}");
    }
}
