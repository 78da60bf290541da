//! Whether a step's MLP input half — gate and up products, their LoRA, SwiGLU — runs with
//! 16-bit activations (issue 29, `THAW_CUDA_BF16_ACT`, on by default, `0` off), as one pure function of the
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
//! - `g = rnd(x·W_gateᵀ)` and `u = rnd(x·W_upᵀ)`: the product is rounded once, on cuBLAS's
//!   store (there is no LoRA on gate or up on this path, see below).
//! - `a = silu(g)·u` in f32; down's product reads `rnd(a)`, down's LoRA shrink reads `a`
//!   (the f32 copy) or, without it, `rnd(a)` too.
//!
//! One performance model decides: the 16-bit path runs only where it moves fewer MLP
//! activation bytes than the f32 path ([`act16_traffic_bytes`], per element of the
//! `rows × inter` products: f32 24 B; 16-bit 12 B, 16 B with the f32 copy).
//!
//! Decisions:
//! - LoRA on gate or up (eager: an adapter of the step targets them at this layer; graph: the
//!   captured key has a LoRA rank class): f32 ([`F32Why::LoraOnGateUp`]). The 16-bit path
//!   would need each row's delta in f32 beside the rounded product — an f32 scratch per
//!   product zeroed (8 B) and read by SwiGLU (8 B) on top of its 12–16 B: 28–32 B per element
//!   against the f32 path's 24 B (at prefill 2048 × 14336, ~117–235 MB more per layer), so
//!   the model keeps f32, where the deltas are added to the f32 products as they are written.
//! - LoRA on down (eager steps): the 16-bit path with the SwiGLU output in f32 too
//!   (`f32_copy`, 16 B against 24 B), which the down LoRA's shrink reads (the base product
//!   reads the 16-bit copy, as it does on the f32 path, where the down GEMM's input is a
//!   16-bit cast).
//! - A CUDA graph capture or replay: the per-step LoRA facts are not read — one graph serves
//!   every step of its bucket, whichever rows have which adapter — so only the graph key's
//!   LoRA rank class decides: with one, f32 (its BGMV kernels may run on gate/up on any
//!   replay); without one (no LoRA kernel runs at all), the 16-bit path without the copy.
//!   Every other fact is fixed per captured bucket.
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
    /// LoRA on gate or up (a graph: its key's rank class): the 16-bit path with the deltas in
    /// f32 would move 28–32 B of activations per element against f32's 24 B (module docs).
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
    /// Whether gate's and up's products are rounded to the 16-bit type before SwiGLU.
    pub fn rounds_gate_up(self) -> bool {
        matches!(self, Self::Act16 { .. })
    }

    /// Whether every consumer of the SwiGLU output (down's product and its LoRA) reads it
    /// rounded: the 16-bit path without the f32 copy.
    pub fn rounds_act(self) -> bool {
        matches!(self, Self::Act16 { f32_copy: false })
    }
}

/// A path the MLP input half could take, as the traffic model prices it: the f32 path, or
/// the 16-bit one with (`delta`) the gate/up LoRA deltas in f32 scratch and (`f32_copy`) the
/// SwiGLU output in f32 too. The 16-bit path with a delta is priced, never planned: it moves
/// more than f32 (module docs), so [`act16_plan`] keeps f32 where it would be needed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ActPath {
    F32,
    Act16 { delta: bool, f32_copy: bool },
}

impl From<Act16Plan> for ActPath {
    fn from(p: Act16Plan) -> Self {
        match p {
            Act16Plan::F32(_) => Self::F32,
            Act16Plan::Act16 { f32_copy } => Self::Act16 {
                delta: false,
                f32_copy,
            },
        }
    }
}

/// The 16-bit path a step's facts would need (LoRA on gate/up: the deltas; LoRA on down: the
/// f32 copy; a graph: both from its key's rank class, never the step's rows), whether or not
/// the plan then takes it.
pub fn act16_path_needed(f: &Act16Facts) -> ActPath {
    let (gate_up, down) = if f.graph {
        (f.graph_lora, f.graph_lora)
    } else {
        (f.lora_on_gate_up, f.lora_on_down)
    };
    ActPath::Act16 {
        delta: gate_up,
        f32_copy: down,
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
    if let Some(w) = why {
        return Act16Plan::F32(w);
    }
    // Only a path the step can take without its LoRA deltas, and only where the model says
    // it moves fewer bytes (linear in rows × inter: one element prices the comparison).
    let need = act16_path_needed(f);
    let fewer = act16_traffic_bytes(need, 1, 1) <= act16_traffic_bytes(ActPath::F32, 1, 1);
    match need {
        ActPath::Act16 {
            delta: false,
            f32_copy,
        } if fewer => Act16Plan::Act16 { f32_copy },
        _ => Act16Plan::F32(F32Why::LoraOnGateUp),
    }
}

/// Bytes of MLP activations a step of `rows` rows and `inter` intermediate width moves between
/// the gate/up products, SwiGLU and down on `path` (an [`Act16Plan`] converts: the products'
/// writes, SwiGLU's reads and writes, down's read of its 16-bit input, a delta scratch's
/// zeroing and SwiGLU's read of it; weights, `x` and the LoRA kernels' own traffic, the same
/// on both paths, are not counted): what [`act16_plan`] compares and `cuda_bench --act16`
/// divides by its time.
pub fn act16_traffic_bytes(path: impl Into<ActPath>, rows: usize, inter: usize) -> usize {
    let n = rows * inter;
    match path.into() {
        // gate, up written f32 (8n), read by SwiGLU (8n), act written f32 + 16-bit (6n), 16-bit
        // read by down (2n).
        ActPath::F32 => 24 * n,
        // gate, up written 16-bit (4n), read (4n), act written 16-bit (+ f32) (2n [+4n]),
        // read by down (2n); with the delta its f32 scratch zeroed (8n) and read (8n).
        ActPath::Act16 { delta, f32_copy } => {
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

    /// Facts where every condition but the LoRA ones holds: the 16-bit path is on offer.
    fn on_offer(f: &Act16Facts) -> bool {
        f.switch_on && f.weights_16bit && f.rows > 0 && !f.gemv && !f.bias
    }

    #[test]
    fn lora_on_gate_up_keeps_f32_and_down_lora_asks_for_the_f32_copy() {
        let mut f = Act16Facts {
            switch_on: true,
            weights_16bit: true,
            rows: 32,
            ..Default::default()
        };
        let sixteen = |f32_copy| Act16Plan::Act16 { f32_copy };
        let lora_f32 = Act16Plan::F32(F32Why::LoraOnGateUp);
        assert_eq!(act16_plan(&f), sixteen(false));
        f.lora_on_down = true;
        assert_eq!(act16_plan(&f), sixteen(true));
        f.lora_on_gate_up = true;
        assert_eq!(act16_plan(&f), lora_f32);
        f.lora_on_down = false;
        assert_eq!(act16_plan(&f), lora_f32);
        // A graph reads its key's rank class, not the step's rows.
        f.graph = true;
        assert_eq!(act16_plan(&f), sixteen(false));
        f.graph_lora = true;
        assert_eq!(act16_plan(&f), lora_f32);
        f.gemv = true;
        assert_eq!(act16_plan(&f), Act16Plan::F32(F32Why::Gemv));
    }

    /// The figures the module docs quote: per element f32 24 B, 16-bit 12 B (16 B with the
    /// copy), with the gate/up delta 28–32 B; at prefill 2048 × 14336 the delta path moves
    /// ~117 MB (no copy) to ~235 MB (with it) more than f32 per layer.
    #[test]
    fn the_delta_path_moves_more_than_f32() {
        let b = |p: ActPath| act16_traffic_bytes(p, 1, 1);
        let a = |delta, f32_copy| ActPath::Act16 { delta, f32_copy };
        assert_eq!(
            [b(ActPath::F32), b(a(false, false)), b(a(false, true))],
            [24, 12, 16]
        );
        assert_eq!([b(a(true, false)), b(a(true, true))], [28, 32]);
        let n = 2048 * 14336;
        let more = act16_traffic_bytes(a(true, true), 2048, 14336) - 24 * n;
        assert_eq!(more, 8 * n);
        assert!((234_000_000..236_000_000).contains(&more), "{more}");
    }

    proptest! {
        /// The 16-bit path runs exactly when every condition of the module docs holds and no
        /// LoRA targets gate or up (a graph: its key has no rank class).
        #[test]
        fn sixteen_bit_exactly_when_every_condition_holds(f in facts()) {
            let gate_up = if f.graph { f.graph_lora } else { f.lora_on_gate_up };
            let p = act16_plan(&f);
            prop_assert_eq!(p.rounds_gate_up(), on_offer(&f) && !gate_up);
            if on_offer(&f) {
                let want = match (gate_up, f.graph) {
                    (true, _) => Act16Plan::F32(F32Why::LoraOnGateUp),
                    (false, true) => Act16Plan::Act16 { f32_copy: false },
                    (false, false) => Act16Plan::Act16 { f32_copy: f.lora_on_down },
                };
                prop_assert_eq!(p, want);
            }
        }

        /// Switched off, no fact matters: every step is the f32 path the backend ran before.
        #[test]
        fn off_is_always_the_f32_path(f in facts()) {
            let f = Act16Facts { switch_on: false, ..f };
            prop_assert_eq!(act16_plan(&f), Act16Plan::F32(F32Why::Off));
        }

        /// One performance model decides: wherever the 16-bit path is on offer, the chosen
        /// path never moves more activation bytes ([`act16_traffic_bytes`]) than the other
        /// path for the same facts (the f32 path, or the 16-bit path those facts would need).
        #[test]
        fn the_chosen_path_never_moves_more_bytes(
            f in facts(), inter in 1usize..20000,
        ) {
            // Every condition but the LoRA ones holds: the 16-bit path is on offer.
            let f = Act16Facts {
                switch_on: true,
                weights_16bit: true,
                rows: f.rows.max(1),
                gemv: false,
                bias: false,
                ..f
            };
            let chosen = act16_plan(&f);
            let other = match chosen {
                Act16Plan::Act16 { .. } => ActPath::F32,
                Act16Plan::F32(_) => act16_path_needed(&f),
            };
            let (c, o) = (
                act16_traffic_bytes(chosen, f.rows, inter),
                act16_traffic_bytes(other, f.rows, inter),
            );
            prop_assert!(c <= o, "{:?} moves {} B, {:?} {} B", chosen, c, other, o);
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

        /// Every LoRA that runs reads an unrounded value: gate/up's deltas are added to f32
        /// products (the f32 path), and a down LoRA's shrink never reads a rounded SwiGLU
        /// output.
        #[test]
        fn lora_reads_f32_where_it_needs_it(f in facts()) {
            let p = act16_plan(&f);
            let (gate_up, down) = if f.graph {
                (f.graph_lora, f.graph_lora)
            } else {
                (f.lora_on_gate_up, f.lora_on_down)
            };
            if gate_up {
                prop_assert!(!p.rounds_gate_up());
            }
            if down {
                prop_assert!(!p.rounds_act());
            }
            prop_assert!(!p.rounds_act() || p.rounds_gate_up());
        }

        /// Without a delta the 16-bit path moves at most two thirds of the f32 path's
        /// activation bytes (half without the f32 copy); with one it moves more than f32.
        #[test]
        fn the_16_bit_path_moves_fewer_bytes_only_without_a_delta(
            rows in 1usize..4096, inter in 1usize..20000, copy: bool, delta: bool,
        ) {
            let f32b = act16_traffic_bytes(ActPath::F32, rows, inter);
            let b16 = act16_traffic_bytes(ActPath::Act16 { delta, f32_copy: copy }, rows, inter);
            if delta {
                prop_assert!(b16 > f32b);
            } else {
                prop_assert!(3 * b16 <= 2 * f32b);
                prop_assert_eq!(2 * b16 == f32b, !copy);
            }
        }
    }
}
