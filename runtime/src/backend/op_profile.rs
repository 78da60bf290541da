//! Where a step's time goes, per op class (issue 29): the classes a profiled step's ops are
//! filed under, and the aggregation of timed ops into table rows (calls, µs, % of the step,
//! and for weight reads bytes and GB/s against a roofline). Pure: the timing itself is
//! [`super::profiled::Profiled`]'s; this file only does arithmetic over its samples, so it is
//! unit-tested on the CPU.
use crate::adapter::LoraModule;

/// The class a backend op is filed under.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpClass {
    Embed,
    RmsNorm,
    /// The residual add fused with the next norm ([`super::Backend::add_rms_norm`]).
    AddRmsNorm,
    /// A base projection of one module (its share of a q/k/v or gate/up group included).
    Linear(LoraModule),
    /// A [`super::Backend::linear`] called outside a module group.
    LinearOther,
    /// One adapter delta `y += B·(A·x)` of one module: shrink and expand together.
    Lora,
    Rope,
    /// KV write plus paged attention.
    Attention,
    Swiglu,
    /// Gate and up products, their LoRA and SwiGLU as one op
    /// ([`super::Backend::gated_mlp_in`] where the backend fuses it: CUDA with
    /// `THAW_CUDA_BF16_ACT=1`).
    GatedMlp,
    /// q/k/v products, their LoRA, RoPE, the K/V write and attention as one op
    /// ([`super::Backend::qkv_attention`] where the backend fuses it: CUDA with
    /// `THAW_CUDA_BF16_ACT=1`).
    QkvAttention,
    ResidualAdd,
    /// Gathering the sample rows before the final norm.
    Gather,
    /// The LM head's product plus the device → host copy of the logits.
    LmHeadLogits,
    /// The LM head's product plus the greedy token ids ([`super::Backend::greedy_ids`]): the
    /// argmax on the device and the ids' copy where the backend has it (CUDA with
    /// `THAW_CUDA_DEVICE_ARGMAX=1`), else the logits' copy and the host's argmax.
    LmHeadIds,
    /// CPU-assist exports and merges.
    Assist,
}

impl OpClass {
    /// The row label of the table.
    pub fn label(self) -> String {
        match self {
            OpClass::Embed => "embed".into(),
            OpClass::RmsNorm => "rms_norm".into(),
            OpClass::AddRmsNorm => "residual add + rms_norm".into(),
            OpClass::Linear(m) => format!("linear {}", m.hf_name()),
            OpClass::LinearOther => "linear (other)".into(),
            OpClass::Lora => "lora shrink + expand".into(),
            OpClass::Rope => "rope".into(),
            OpClass::Attention => "attention (KV write + paged)".into(),
            OpClass::Swiglu => "swiglu".into(),
            OpClass::GatedMlp => "linear gate_proj + up_proj + lora + swiglu".into(),
            OpClass::QkvAttention => "linear q/k/v_proj + lora + rope + attention".into(),
            OpClass::ResidualAdd => "residual add".into(),
            OpClass::Gather => "gather sample rows".into(),
            OpClass::LmHeadLogits => "linear lm_head + logits copy".into(),
            OpClass::LmHeadIds => "linear lm_head + ids copy".into(),
            OpClass::Assist => "cpu-assist export/merge".into(),
        }
    }
}

/// One timed op.
///
/// On CUDA `us` is the device time between the events recorded before and after the op was
/// issued: the op's kernels where the device was busy with earlier work when the host issued
/// them (device-bound), but also the device's wait for the host where it was idle (a
/// host-bound op's launch gaps). `host_us` (how long the host took to issue the op) and
/// `gap_us` (device time between the previous op's end event and this op's start event: the
/// device waiting for the host between ops, plus the profiler's own event records) tell the
/// two apart: an op with `host_us` near or above `us`, or a step with large gaps, is bound by
/// the host; one with `us` well above `host_us` and no gaps is bound by the device.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct OpSample {
    pub class: OpClass,
    /// Its time, µs (device time between events on CUDA, wall clock on the CPU).
    pub us: f64,
    /// Host wall time of the call that issued it, µs.
    pub host_us: f64,
    /// Time from the previous op's end mark to this op's start mark, µs (0 for the first op
    /// of a recording).
    pub gap_us: f64,
}

/// One row of the table: one class over the profiled steps, per step.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    pub class: OpClass,
    /// Calls per step.
    pub calls: f64,
    /// µs per step.
    pub us: f64,
    /// Host µs per step issuing this class's ops.
    pub host_us: f64,
    /// µs per step between the previous op's end and this class's ops' starts.
    pub gap_us: f64,
    /// Share of the measured step, in percent.
    pub share: f64,
    /// Bytes of weights read per step (classes that read weights: the linears).
    pub bytes: Option<f64>,
    /// Achieved bandwidth, GB/s (bytes over µs).
    pub gbs: Option<f64>,
    /// `gbs` as a percentage of the roofline.
    pub roofline_pct: Option<f64>,
}

/// The rows of one profile plus what no op accounts for.
#[derive(Clone, Debug, PartialEq)]
pub struct OpProfile {
    /// Rows in [`OpClass`] order, only classes that ran.
    pub rows: Vec<ProfileRow>,
    /// Mean measured step, µs.
    pub step_us: f64,
    /// Step time outside every timed op, µs: host work (planning, sampling, launch gaps on a
    /// GPU the host starves). Negative only when timer overheads exceed the gaps.
    pub outside_us: f64,
}

impl OpProfile {
    /// µs per step inside timed ops.
    pub fn ops_us(&self) -> f64 {
        self.rows.iter().map(|r| r.us).sum()
    }

    /// Host µs per step issuing the timed ops.
    pub fn host_us(&self) -> f64 {
        self.rows.iter().map(|r| r.host_us).sum()
    }

    /// µs per step between consecutive timed ops (see [`OpSample::gap_us`]).
    pub fn gaps_us(&self) -> f64 {
        self.rows.iter().map(|r| r.gap_us).sum()
    }
}

/// Aggregates the samples of `steps` profiled steps whose measured mean is `step_us` into
/// per-step rows. `bytes_per_call(class)` gives the bytes one call of a class reads where
/// that is known (a linear's weight); `peak_gbs` is the roofline its bandwidth is compared
/// with.
pub fn aggregate(
    samples: &[OpSample],
    steps: usize,
    step_us: f64,
    bytes_per_call: &dyn Fn(OpClass) -> Option<f64>,
    peak_gbs: f64,
) -> OpProfile {
    let n = steps.max(1) as f64;
    let mut by: std::collections::BTreeMap<OpClass, (usize, [f64; 3])> = Default::default();
    for s in samples {
        let e = by.entry(s.class).or_default();
        e.0 += 1;
        e.1[0] += s.us;
        e.1[1] += s.host_us;
        e.1[2] += s.gap_us;
    }
    let rows: Vec<ProfileRow> = by
        .into_iter()
        .map(|(class, (calls, [us, host_us, gap_us]))| {
            let (calls, us) = (calls as f64 / n, us / n);
            let bytes = bytes_per_call(class).map(|b| b * calls);
            // bytes / µs = MB/s; / 1e3 = GB/s.
            let gbs = bytes.filter(|_| us > 0.0).map(|b| b / us / 1e3);
            ProfileRow {
                class,
                calls,
                us,
                host_us: host_us / n,
                gap_us: gap_us / n,
                share: if step_us > 0.0 {
                    us / step_us * 100.0
                } else {
                    0.0
                },
                bytes,
                gbs,
                roofline_pct: gbs.filter(|_| peak_gbs > 0.0).map(|g| g / peak_gbs * 100.0),
            }
        })
        .collect();
    let ops: f64 = rows.iter().map(|r| r.us).sum();
    OpProfile {
        rows,
        step_us,
        outside_us: step_us - ops,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(class: OpClass, us: f64) -> OpSample {
        OpSample {
            class,
            us,
            host_us: us / 2.0,
            gap_us: 1.0,
        }
    }

    #[test]
    fn groups_by_class_per_step_with_bandwidth() {
        let q = OpClass::Linear(LoraModule::Q);
        // Two steps: each runs q twice (10 + 30 µs, 20 + 20 µs) and one rope of 5 µs.
        let samples = [
            s(q, 10.0),
            s(OpClass::Rope, 5.0),
            s(q, 30.0),
            s(q, 20.0),
            s(q, 20.0),
            s(OpClass::Rope, 5.0),
        ];
        let bytes = |c: OpClass| (c == q).then_some(2.0e6);
        let p = aggregate(&samples, 2, 100.0, &bytes, 1000.0);
        assert_eq!(p.rows.len(), 2);
        let (lin, rope) = (&p.rows[0], &p.rows[1]);
        assert_eq!(lin.class, q, "rows follow the class order");
        assert_eq!((lin.calls, lin.us, lin.share), (2.0, 40.0, 40.0));
        // 4 MB per step in 40 µs: 100 GB/s, 10% of a 1000 GB/s roofline.
        assert_eq!(lin.bytes, Some(4.0e6));
        assert!((lin.gbs.unwrap() - 100.0).abs() < 1e-9);
        assert!((lin.roofline_pct.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!((rope.calls, rope.us, rope.gbs), (1.0, 5.0, None));
        assert!((p.outside_us - 55.0).abs() < 1e-9);
        assert!((p.ops_us() - 45.0).abs() < 1e-9);
        // Host time and gaps per step too: half of each op's µs, 1 µs before each op.
        assert_eq!((lin.host_us, lin.gap_us), (20.0, 2.0));
        assert_eq!((rope.host_us, rope.gap_us), (2.5, 1.0));
        assert!((p.host_us() - 22.5).abs() < 1e-9 && (p.gaps_us() - 3.0).abs() < 1e-9);
    }

    #[test]
    fn no_samples_leave_the_whole_step_outside() {
        let p = aggregate(&[], 3, 70.0, &|_| None, 1.0);
        assert!(p.rows.is_empty());
        assert_eq!(p.outside_us, 70.0);
    }

    proptest! {
        /// Rows plus the outside time are the step; shares are the rows' µs over the step.
        #[test]
        fn rows_and_outside_sum_to_the_step(
            us in proptest::collection::vec((0usize..14, 0.0f64..1e4), 0..200),
            steps in 1usize..5,
            step_us in 1.0f64..1e6,
        ) {
            let classes = [
                OpClass::Embed, OpClass::RmsNorm, OpClass::AddRmsNorm,
                OpClass::Linear(LoraModule::Q), OpClass::Linear(LoraModule::Down),
                OpClass::LinearOther, OpClass::Lora, OpClass::Rope, OpClass::Attention,
                OpClass::Swiglu, OpClass::ResidualAdd, OpClass::Gather, OpClass::LmHeadLogits,
                OpClass::LmHeadIds,
            ];
            let samples: Vec<OpSample> =
                us.iter().map(|&(c, t)| s(classes[c], t)).collect();
            let p = aggregate(&samples, steps, step_us, &|_| Some(1.0), 100.0);
            let total: f64 = samples.iter().map(|x| x.us).sum::<f64>() / steps as f64;
            prop_assert!((p.ops_us() + p.outside_us - step_us).abs() <= 1e-9 * step_us.max(total));
            prop_assert!((p.ops_us() - total).abs() <= 1e-9 * total.max(1.0));
            let calls: f64 = p.rows.iter().map(|r| r.calls).sum();
            prop_assert!((calls - samples.len() as f64 / steps as f64).abs() < 1e-9);
            for r in &p.rows {
                prop_assert!((r.share - r.us / step_us * 100.0).abs() < 1e-9);
            }
            // Distinct classes, in order.
            prop_assert!(p.rows.windows(2).all(|w| w[0].class < w[1].class));
        }
    }
}
