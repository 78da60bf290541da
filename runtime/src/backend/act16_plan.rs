//! Whether a step's MLP input half — gate and up products, their LoRA, SwiGLU — runs with
//! 16-bit activations (issue 29, `THAW_CUDA_BF16_ACT=1`, opt-in), as one pure function of the
//! step's facts, so the rule is property-tested on the CPU and the CPU emulation
//! ([`CpuBackend::set_act16`](super::cpu::CpuBackend::set_act16)) rounds exactly where the
//! CUDA path does.
//!
//! On the 16-bit path the gate and up GEMMs write their outputs in the weight dtype (f32
//! accumulation inside cuBLAS, one rounding on the store), a SwiGLU kernel reads the two
//! 16-bit buffers and writes the down projection's 16-bit input, which down reads without a
//! cast. The f32 path writes gate and up in f32 and SwiGLU reads them: twice the bytes.
//!
//! Rounding, per element of a row (`rnd` = the weight dtype's round to nearest even):
//! - `g = rnd(x·W_gateᵀ) + Δg` and `u = rnd(x·W_upᵀ) + Δu` in f32, where `Δ` is the row's LoRA
//!   delta (f32 shrink and expand into a zeroed f32 scratch; 0 for a row without one). The
//!   base product is rounded once, on cuBLAS's store; the delta and the sum are not rounded.
//! - `a = silu(g)·u` in f32; down's product reads `rnd(a)`, down's LoRA shrink reads `a`
//!   (the f32 copy) or, without it, `rnd(a)` too.
//!
//! Decisions:
//! - LoRA on gate or up (eager: an adapter of the step targets them at this layer; graph: the
//!   captured key has a LoRA rank class): the 16-bit path with `delta` — the deltas are
//!   expanded into the f32 gate/up scratch (zeroed first) and SwiGLU adds them to the 16-bit
//!   base products as it reads them.
//! - LoRA on down (same two readings): the 16-bit path with the SwiGLU output in f32 too
//!   (`f32_copy`), which the down LoRA's shrink reads (the base product reads the 16-bit copy,
//!   as it does on the f32 path, where the down GEMM's input is a 16-bit cast).
//! - A CUDA graph capture or replay: the per-step LoRA facts are not read — one graph serves
//!   every step of its bucket, whichever rows have which adapter — so `delta` and `f32_copy`
//!   are both the graph key's LoRA rank class being non-zero (a graph without a rank class
//!   runs no LoRA kernel at all). Every other fact is fixed per captured bucket.
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
    /// Rows of the step (a graph's: its bucket).
    pub rows: usize,
    /// Some adapter of the step targets gate or up at this layer (eager steps only).
    pub lora_on_gate_up: bool,
    /// Some adapter of the step targets down at this layer (eager steps only).
    pub lora_on_down: bool,
    /// A CUDA graph is being captured or replayed.
    pub graph: bool,
    /// The graph's key has a LoRA rank class: its BGMV kernels run on every replay (graph
    /// steps only; fixed per captured graph).
    pub graph_lora: bool,
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
    Gemv,
    Bias,
}

/// How a step's MLP input half runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Act16Plan {
    /// Gate and up in f32, f32 SwiGLU (the backend's `linear_group_lora` then `swiglu`).
    F32(F32Why),
    /// Gate and up in 16 bits, the 16-bit SwiGLU; with `delta` the LoRA deltas of gate and up
    /// in f32 scratch, added by SwiGLU; with `f32_copy` its output in f32 too.
    Act16 { delta: bool, f32_copy: bool },
}

impl Act16Plan {
    /// Whether gate's and up's base products are rounded to the 16-bit type before SwiGLU.
    pub fn rounds_gate_up(self) -> bool {
        matches!(self, Self::Act16 { .. })
    }

    /// Whether SwiGLU adds f32 LoRA deltas to the rounded base products.
    pub fn adds_delta(self) -> bool {
        matches!(self, Self::Act16 { delta: true, .. })
    }

    /// Whether every consumer of the SwiGLU output (down's product and its LoRA) reads it
    /// rounded: the 16-bit path without the f32 copy.
    pub fn rounds_act(self) -> bool {
        matches!(
            self,
            Self::Act16 {
                f32_copy: false,
                ..
            }
        )
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
    } else if f.gemv {
        Some(F32Why::Gemv)
    } else if f.bias {
        Some(F32Why::Bias)
    } else {
        None
    };
    match why {
        Some(w) => Act16Plan::F32(w),
        None if f.graph => Act16Plan::Act16 {
            delta: f.graph_lora,
            f32_copy: f.graph_lora,
        },
        None => Act16Plan::Act16 {
            delta: f.lora_on_gate_up,
            f32_copy: f.lora_on_down,
        },
    }
}

/// Bytes of MLP activations a step of `rows` rows and `inter` intermediate width moves between
/// the gate/up products, SwiGLU and down under `plan` (the products' writes, SwiGLU's reads and
/// writes, down's read of its 16-bit input, the delta scratch's zeroing and SwiGLU's read of
/// it; weights, `x` and the LoRA kernels' own traffic, the same on both paths, are not
/// counted): what `cuda_bench --act16` divides by its time.
pub fn act16_traffic_bytes(plan: Act16Plan, rows: usize, inter: usize) -> usize {
    let n = rows * inter;
    match plan {
        // gate, up written f32 (8n), read by SwiGLU (8n), act written f32 + 16-bit (6n), 16-bit
        // read by down (2n).
        Act16Plan::F32(_) => 24 * n,
        // gate, up written 16-bit (4n), read (4n), act written 16-bit (+ f32) (2n [+4n]),
        // read by down (2n); with the delta its f32 scratch zeroed (8n) and read (8n).
        Act16Plan::Act16 { delta, f32_copy } => {
            12 * n + if f32_copy { 4 * n } else { 0 } + if delta { 16 * n } else { 0 }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts() -> impl Strategy<Value = Act16Facts> {
        (any::<[bool; 8]>(), prop_oneof![Just(0usize), 1usize..4096]).prop_map(|(b, rows)| {
            Act16Facts {
                switch_on: b[0],
                weights_16bit: b[1],
                rows,
                lora_on_gate_up: b[2],
                lora_on_down: b[3],
                graph: b[4],
                graph_lora: b[5],
                gemv: b[6],
                bias: b[7],
            }
        })
    }

    #[test]
    fn lora_on_gate_up_adds_its_delta_and_down_lora_asks_for_the_f32_copy() {
        let mut f = Act16Facts {
            switch_on: true,
            weights_16bit: true,
            rows: 32,
            ..Default::default()
        };
        let plan = |delta, f32_copy| Act16Plan::Act16 { delta, f32_copy };
        assert_eq!(act16_plan(&f), plan(false, false));
        f.lora_on_down = true;
        assert_eq!(act16_plan(&f), plan(false, true));
        f.lora_on_gate_up = true;
        assert_eq!(act16_plan(&f), plan(true, true));
        f.lora_on_down = false;
        assert_eq!(act16_plan(&f), plan(true, false));
        // A graph reads its key's rank class, not the step's rows.
        f.graph = true;
        assert_eq!(act16_plan(&f), plan(false, false));
        f.graph_lora = true;
        assert_eq!(act16_plan(&f), plan(true, true));
        f.gemv = true;
        assert_eq!(act16_plan(&f), Act16Plan::F32(F32Why::Gemv));
    }

    proptest! {
        /// The 16-bit path runs exactly when every condition of the module docs holds, LoRA
        /// or not, graph or not.
        #[test]
        fn sixteen_bit_exactly_when_every_condition_holds(f in facts()) {
            let all = f.switch_on && f.weights_16bit && f.rows > 0 && !f.gemv && !f.bias;
            let p = act16_plan(&f);
            prop_assert_eq!(p.rounds_gate_up(), all);
            if all && !f.graph {
                let want = Act16Plan::Act16 { delta: f.lora_on_gate_up, f32_copy: f.lora_on_down };
                prop_assert_eq!(p, want);
            }
        }

        /// Switched off, no fact matters: every step is the f32 path the backend ran before.
        #[test]
        fn off_is_always_the_f32_path(f in facts()) {
            let f = Act16Facts { switch_on: false, ..f };
            prop_assert_eq!(act16_plan(&f), Act16Plan::F32(F32Why::Off));
        }

        /// In graph mode the plan never depends on the step's LoRA facts (a captured graph
        /// replays one path for every step of its bucket), only on facts fixed per captured
        /// key; out of graph mode it never depends on the key's rank class.
        #[test]
        fn a_graph_plan_never_reads_the_steps_lora_facts(f in facts(), a: bool, b: bool) {
            let g = Act16Facts { graph: true, ..f };
            let other = Act16Facts { lora_on_gate_up: a, lora_on_down: b, ..g };
            prop_assert_eq!(act16_plan(&g), act16_plan(&other));
            let e = Act16Facts { graph: false, ..f };
            prop_assert_eq!(act16_plan(&e), act16_plan(&Act16Facts { graph_lora: a, ..e }));
        }

        /// Every row whose LoRA can run gets it on an unrounded value: a gate/up delta is added
        /// in f32 after the base product's one rounding (never dropped, never rounded again),
        /// and a down LoRA's shrink never reads a rounded SwiGLU output.
        #[test]
        fn lora_reads_f32_where_it_needs_it(f in facts()) {
            let p = act16_plan(&f);
            let (gate_up, down) = if f.graph {
                (f.graph_lora, f.graph_lora)
            } else {
                (f.lora_on_gate_up, f.lora_on_down)
            };
            if p.rounds_gate_up() {
                prop_assert_eq!(p.adds_delta(), gate_up);
            } else {
                prop_assert!(!p.adds_delta());
            }
            if down {
                prop_assert!(!p.rounds_act());
            }
            prop_assert!(!p.rounds_act() || p.rounds_gate_up());
        }

        /// Without a delta the 16-bit path moves at most two thirds of the f32 path's
        /// activation bytes (half without the f32 copy); the delta's zeroing and read cost at
        /// most a third more than the f32 path.
        #[test]
        fn the_16_bit_path_moves_fewer_bytes_without_a_delta(
            rows in 1usize..4096, inter in 1usize..20000, copy: bool, delta: bool,
        ) {
            let f32b = act16_traffic_bytes(Act16Plan::F32(F32Why::Off), rows, inter);
            let b16 = act16_traffic_bytes(Act16Plan::Act16 { delta, f32_copy: copy }, rows, inter);
            if delta {
                prop_assert!(3 * b16 <= 4 * f32b);
            } else {
                prop_assert!(3 * b16 <= 2 * f32b);
                prop_assert_eq!(2 * b16 == f32b, !copy);
            }
        }
    }
}
