//! Whether a step's MLP input half — gate and up products, their LoRA, SwiGLU — runs with
//! 16-bit activations (issue 29, `THAW_CUDA_BF16_ACT=1`, opt-in), as one pure function of the
//! step's facts, so the rule is property-tested on the CPU and the CPU emulation
//! ([`CpuBackend::set_act16`](super::cpu::CpuBackend::set_act16)) rounds exactly where the
//! CUDA path does.
//!
//! On the 16-bit path the gate and up GEMMs write their outputs in the weight dtype (f32
//! accumulation inside cuBLAS, one rounding on the store), a SwiGLU kernel reads the two
//! 16-bit buffers and writes the down projection's 16-bit input, which down reads without a
//! cast. The f32 path (the default) writes gate and up in f32 and SwiGLU reads them: twice the
//! bytes. Decisions:
//! - LoRA on gate or up (any adapter of the step targets them at this layer): f32. The delta is
//!   added into f32 outputs before SwiGLU; a 16-bit output would need an expand that reads,
//!   adds and re-rounds, so such a step keeps the f32 path whole.
//! - LoRA on down: the 16-bit path, plus the SwiGLU output in f32 too (`f32_copy`), which the
//!   down LoRA's shrink reads (the base product reads the 16-bit copy, as it does on the f32
//!   path, where the down GEMM's input is a 16-bit cast).
//! - A CUDA graph capture or replay: f32 (a graph holds one path for every step of its bucket,
//!   LoRA or not).
//! - Products the small-batch GEMV takes (it reads f32 activations, writes f32): f32.
//! - Gate or up with a bias (not Llama's MLP): f32.
//! - f32 weights: f32 (there is no 16-bit type to store in).

/// What the plan is decided from, per layer of a step.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Act16Facts {
    /// `THAW_CUDA_BF16_ACT=1` (or the test switch).
    pub switch_on: bool,
    /// The weights are bf16 or f16 (the 16-bit type the activations are stored in).
    pub weights_16bit: bool,
    /// Rows of the step.
    pub rows: usize,
    /// Some adapter of the step targets gate or up at this layer.
    pub lora_on_gate_up: bool,
    /// Some adapter of the step targets down at this layer.
    pub lora_on_down: bool,
    /// A CUDA graph is being captured or replayed.
    pub graph: bool,
    /// The small-batch GEMV takes the gate/up (or down) products of these rows.
    pub gemv: bool,
    /// Gate or up has a bias.
    pub bias: bool,
}

/// Why a step's MLP stays on f32 activations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum F32Why {
    Off,
    F32Weights,
    NoRows,
    Graph,
    Gemv,
    Bias,
    LoraOnGateUp,
}

/// How a step's MLP input half runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Act16Plan {
    /// Gate and up in f32, f32 SwiGLU (the backend's `linear_group_lora` then `swiglu`).
    F32(F32Why),
    /// Gate and up in 16 bits, the 16-bit SwiGLU; with `f32_copy` its output in f32 too.
    Act16 { f32_copy: bool },
}

impl Act16Plan {
    /// Whether gate and up are rounded to the 16-bit type before SwiGLU.
    pub fn rounds_gate_up(self) -> bool {
        matches!(self, Self::Act16 { .. })
    }

    /// Whether every consumer of the SwiGLU output (down's product and its LoRA) reads it
    /// rounded: the 16-bit path without the f32 copy.
    pub fn rounds_act(self) -> bool {
        self == Self::Act16 { f32_copy: false }
    }
}

/// The plan for one layer of a step (see the module docs for each rule); the first reason that
/// applies, in the order of [`F32Why`], names an f32 step.
pub fn act16_plan(f: &Act16Facts) -> Act16Plan {
    let why = if !f.switch_on {
        Some(F32Why::Off)
    } else if !f.weights_16bit {
        Some(F32Why::F32Weights)
    } else if f.rows == 0 {
        Some(F32Why::NoRows)
    } else if f.graph {
        Some(F32Why::Graph)
    } else if f.gemv {
        Some(F32Why::Gemv)
    } else if f.bias {
        Some(F32Why::Bias)
    } else if f.lora_on_gate_up {
        Some(F32Why::LoraOnGateUp)
    } else {
        None
    };
    match why {
        Some(w) => Act16Plan::F32(w),
        None => Act16Plan::Act16 {
            f32_copy: f.lora_on_down,
        },
    }
}

/// Bytes of MLP activations a step of `rows` rows and `inter` intermediate width moves between
/// the gate/up products, SwiGLU and down under `plan` (the products' writes, SwiGLU's reads and
/// writes, down's read of its 16-bit input; weights and `x` are the same either way): what
/// `cuda_bench --act16` divides by its time.
pub fn act16_traffic_bytes(plan: Act16Plan, rows: usize, inter: usize) -> usize {
    let n = rows * inter;
    match plan {
        // gate, up written f32 (8n), read by SwiGLU (8n), act written f32 + 16-bit (6n), 16-bit
        // read by down (2n).
        Act16Plan::F32(_) => 24 * n,
        // gate, up written 16-bit (4n), read (4n), act written 16-bit (+ f32) (2n [+4n]),
        // read by down (2n).
        Act16Plan::Act16 { f32_copy } => 12 * n + if f32_copy { 4 * n } else { 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts() -> impl Strategy<Value = Act16Facts> {
        (any::<[bool; 7]>(), prop_oneof![Just(0usize), 1usize..4096]).prop_map(|(b, rows)| {
            Act16Facts {
                switch_on: b[0],
                weights_16bit: b[1],
                rows,
                lora_on_gate_up: b[2],
                lora_on_down: b[3],
                graph: b[4],
                gemv: b[5],
                bias: b[6],
            }
        })
    }

    #[test]
    fn a_plain_step_runs_16_bit_and_down_lora_asks_for_the_f32_copy() {
        let mut f = Act16Facts {
            switch_on: true,
            weights_16bit: true,
            rows: 32,
            ..Default::default()
        };
        assert_eq!(act16_plan(&f), Act16Plan::Act16 { f32_copy: false });
        f.lora_on_down = true;
        assert_eq!(act16_plan(&f), Act16Plan::Act16 { f32_copy: true });
        f.lora_on_gate_up = true;
        assert_eq!(act16_plan(&f), Act16Plan::F32(F32Why::LoraOnGateUp));
    }

    proptest! {
        /// The 16-bit path runs exactly when every condition of the module docs holds.
        #[test]
        fn sixteen_bit_exactly_when_every_condition_holds(f in facts()) {
            let all = f.switch_on && f.weights_16bit && f.rows > 0 && !f.graph && !f.gemv
                && !f.bias && !f.lora_on_gate_up;
            let p = act16_plan(&f);
            prop_assert_eq!(p.rounds_gate_up(), all);
            if all {
                prop_assert_eq!(p, Act16Plan::Act16 { f32_copy: f.lora_on_down });
            }
        }

        /// Switched off, no fact matters: every step is the f32 path the backend ran before.
        #[test]
        fn off_is_always_the_f32_path(f in facts()) {
            let f = Act16Facts { switch_on: false, ..f };
            prop_assert_eq!(act16_plan(&f), Act16Plan::F32(F32Why::Off));
        }

        /// A row with LoRA on down never reads a rounded SwiGLU output through its shrink; a
        /// row with LoRA on gate or up never has its base output rounded before the delta.
        #[test]
        fn lora_reads_f32_where_it_needs_it(f in facts()) {
            let p = act16_plan(&f);
            if f.lora_on_down {
                prop_assert!(!p.rounds_act());
            }
            if f.lora_on_gate_up {
                prop_assert!(!p.rounds_gate_up());
            }
            prop_assert!(!p.rounds_act() || p.rounds_gate_up());
        }

        /// The 16-bit path moves at most two thirds of the f32 path's activation bytes (half
        /// without the f32 copy).
        #[test]
        fn the_16_bit_path_moves_fewer_bytes(rows in 1usize..4096, inter in 1usize..20000, copy: bool) {
            let f32b = act16_traffic_bytes(Act16Plan::F32(F32Why::Off), rows, inter);
            let b16 = act16_traffic_bytes(Act16Plan::Act16 { f32_copy: copy }, rows, inter);
            prop_assert!(3 * b16 <= 2 * f32b);
            prop_assert_eq!(2 * b16 == f32b, !copy);
        }
    }
}
