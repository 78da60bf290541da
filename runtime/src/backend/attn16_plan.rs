//! Whether a step's attention half — the q/k/v products, RoPE and the K/V write, and the
//! attention output o_proj reads — runs with 16-bit activations (issue 29, `THAW_CUDA_BF16_ACT`, on by default, the same switch as the
//! MLP's [`act16_plan`](super::act16_plan)), as one pure function of the step's facts, so the
//! rule is property-tested on the CPU and the CPU emulation
//! ([`CpuBackend::set_act16`](super::cpu::CpuBackend::set_act16)) rounds exactly where the CUDA
//! path does.
//!
//! On the 16-bit path the q, k and v GEMMs store their outputs in the weight dtype (f32
//! accumulation inside cuBLAS, one rounding on the store) and one kernel (`qkv_rope16_*`,
//! `attn16.cu`) reads the three 16-bit buffers, rotates q and k in f32 with `write_kv_rope`'s
//! angles, writes K and V into the paged cache in the KV dtype and the rotated q in f32, which
//! every attention kernel reads. The f32 path writes q, k, v in f32 and RoPE reads and writes
//! them again in f32.
//!
//! Rounding, per element of a row (`rnd` = the weight dtype's round to nearest even):
//! `q = rnd(x·W_qᵀ)`, `k = rnd(x·W_kᵀ)`, `v = rnd(x·W_vᵀ)`, each rounded once on cuBLAS's store
//! (no LoRA targets q, k or v on this path, see below); RoPE in f32 over the rounded values; K
//! and V then rounded into the KV dtype as on the f32 path.
//!
//! One performance model decides ([`attn16_traffic_bytes`], per row of `q` query and `kv`
//! key/value widths; the K/V cache writes and the attention kernels' read of the f32 q, the
//! same on both paths, are not counted; the attention output's bytes, below, come on top of
//! these):
//! - f32: products write q, k, v in f32 (4q + 8kv), the folded RoPE + KV write reads them
//!   (4q + 8kv) and writes q and k back (4q + 4kv): 12q + 20kv B (the fewest the f32 path
//!   moves: with RoPE not folded, `THAW_CUDA_ROPE_FOLD=0`, k is read once more, 12q + 24kv);
//! - 16-bit: products write 16-bit (2q + 4kv), the kernel reads them (2q + 4kv) and writes q
//!   in f32 (4q): 8q + 8kv B. Llama-3-8B (q 4096, kv 1024): 40 KiB against 68 KiB a row, 59 %;
//! - 16-bit with the q/k/v LoRA deltas in f32 scratch beside the rounded products (zeroed,
//!   4q + 8kv, and read by the kernel, 4q + 8kv): 16q + 24kv B, more than f32 for every shape
//!   (Llama-3-8B: 88 KiB a row), so LoRA on q/k/v keeps f32, as the MLP's gate/up LoRA does.
//!
//! The attention output (`rows × q`, o_proj's input) is priced too. On the f32 path the
//! attention kernels write it in f32 (4q), o_proj's cast reads it (4q) and writes its 16-bit
//! copy (2q), the GEMM reads that (2q): 12q B a row and one cast launch a layer. Where the
//! 16-bit path also stores the output 16-bit (`out16`) the attention kernels round it once on
//! their store into the 16-bit scratch o_proj's GEMM reads (write 2q, read 2q): 4q B, no cast.
//! Totals a row: f32 24q + 20kv, 16-bit with an f32 output 20q + 8kv, with a 16-bit output
//! 12q + 8kv (Llama-3-8B: 116 KiB, 88 KiB, 56 KiB, 48 %).
//!
//! Rounding, the attention output: `attn = rnd(softmax(q·Kᵀ)·V)` computed in f32 and rounded
//! once, exactly the value o_proj's cast of the f32 output makes, so o's product reads the same
//! bits on both paths (`cpu_attn16.rs`).
//!
//! Decisions:
//! - LoRA on q, k or v (eager: an adapter of the step targets one at this layer; graph: the
//!   captured key has a LoRA rank class): f32 ([`AttnF32Why::LoraOnQkv`], the model above).
//! - A CUDA graph capture or replay: the per-step LoRA facts are not read (one graph serves
//!   every step of its bucket), only the key's rank class. Every other fact is fixed per key.
//! - Products the small-batch GEMV takes (it reads and writes f32): f32.
//! - q, k or v with a bias (Qwen2): f32 (the bias would be added after the product's rounding,
//!   where the f32 path adds it before; the rounding point is kept to cuBLAS's one store).
//! - A head size the folded RoPE kernel does not take (odd, or above its staged table): f32.
//! - f32 weights: f32 (there is no 16-bit type to store in).
//!
//! The output, on the 16-bit path only (the f32 path's `rope_attention` keeps its f32 store:
//! LoRA on q/k/v, the CPU-assist path and the GEMV steps keep o_proj's cast), stays f32 where
//! ([`OutF32Why`]):
//! - a LoRA on o may read it (eager: any adapter of the step targets o at this layer, landed
//!   or not, since the CPU-assist path exports f32 `attn` rows for an adapter not yet on the
//!   device and the shrink reads f32 rows; graph: the key has a LoRA rank class, whose BGMV
//!   kernels read every row on every replay). No kernel writes both types (that would double
//!   the entry points), so o's LoRA never reads a rounded value;
//! - the attention kernel family this step launches has no 16-bit store for the backend's
//!   (KV, weight) dtypes (the tensor-core prefill stores 16-bit only in the cache's dtype);
//! - the GEMV would take o's product (it reads f32): the plan's GEMV fact, rows at most the
//!   GEMV's, already keeps the whole step f32, o included.

/// What the plan is decided from, per layer of a step.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Attn16Facts {
    /// `THAW_CUDA_BF16_ACT=1` (or the test switch).
    pub switch_on: bool,
    /// The weights are bf16 or f16 (the 16-bit type the activations are stored in).
    pub weights_16bit: bool,
    /// Rows of the step (a graph's: its bucket).
    pub rows: usize,
    /// Some adapter of the step targets q, k or v at this layer (eager steps only).
    pub lora_on_qkv: bool,
    /// A CUDA graph is being captured or replayed.
    pub graph: bool,
    /// The graph's key has a LoRA rank class: its BGMV kernels run on every replay (graph
    /// steps only; fixed per captured graph).
    pub graph_lora: bool,
    /// The small-batch GEMV takes the q/k/v products of these rows.
    pub gemv: bool,
    /// q, k or v has a bias (Qwen2).
    pub bias: bool,
    /// The folded RoPE kernel does not take this head size.
    pub rope_unserved: bool,
    /// Some adapter of the step targets o at this layer, on the device or not (eager steps
    /// only): its LoRA, or the CPU-assist path's export, reads the f32 attention output.
    pub lora_on_o: bool,
    /// The attention kernel family this step launches has no 16-bit-output entry for the
    /// backend's (KV, weight) dtypes.
    pub out16_unserved: bool,
}

/// Why a step's attention input half stays on f32 activations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AttnF32Why {
    Off,
    F32Weights,
    NoRows,
    Gemv,
    Bias,
    RopeUnserved,
    /// LoRA on q, k or v (a graph: its key's rank class): the 16-bit path with the deltas in
    /// f32 would move 16q + 24kv B a row against f32's 12q + 20kv (module docs).
    LoraOnQkv,
}

/// Why the 16-bit path's attention output stays f32 (o_proj casts it).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OutF32Why {
    /// A LoRA on o may read it (a graph: its key's rank class).
    LoraOnO,
    /// The step's attention kernel family has no 16-bit store for these dtypes.
    Unserved,
}

/// How a step's q/k/v products and RoPE run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Attn16Plan {
    /// q, k, v in f32, then the backend's `rope_attention` (its LoRA through
    /// `linear_group_lora`); the attention output in f32.
    F32(AttnF32Why),
    /// q, k, v stored 16-bit, RoPE and the K/V write from them, q rotated into f32; the
    /// attention output stored 16-bit as o_proj's GEMM input (`Ok(())`) or in f32.
    Attn16 { out: Result<(), OutF32Why> },
}

impl Attn16Plan {
    /// Whether the q, k and v products are rounded to the 16-bit type before RoPE.
    pub fn rounds_qkv(self) -> bool {
        matches!(self, Self::Attn16 { .. })
    }

    /// Whether the attention kernels store their output in the 16-bit type (o_proj's GEMM
    /// input; its f32 buffer is then not written).
    pub fn stores_out16(self) -> bool {
        matches!(self, Self::Attn16 { out: Ok(()) })
    }
}

/// A path the attention half could take, as the traffic model prices it: the f32 path, or the
/// 16-bit one with (`delta`) the q/k/v LoRA deltas in f32 scratch and (`out16`) the attention
/// output stored 16-bit. The 16-bit path with a delta is priced, never planned: it moves more
/// than f32 (module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AttnPath {
    F32,
    Attn16 { delta: bool, out16: bool },
}

impl From<Attn16Plan> for AttnPath {
    fn from(p: Attn16Plan) -> Self {
        match p {
            Attn16Plan::F32(_) => Self::F32,
            Attn16Plan::Attn16 { out } => Self::Attn16 {
                delta: false,
                out16: out.is_ok(),
            },
        }
    }
}

/// The 16-bit path a step's facts would need (LoRA on q/k/v: the deltas, then the output in
/// f32 as the f32 path stores it; else the output 16-bit unless a LoRA on o may read it or the
/// family has no 16-bit store; a graph: LoRA from its key's rank class, never the step's
/// rows), whether or not the plan then takes it.
pub fn attn16_path_needed(f: &Attn16Facts) -> AttnPath {
    let delta = if f.graph { f.graph_lora } else { f.lora_on_qkv };
    AttnPath::Attn16 {
        delta,
        out16: !delta && out16_blocker(f).is_none(),
    }
}

/// Why the output of a 16-bit step would stay f32 (module docs), if it would.
fn out16_blocker(f: &Attn16Facts) -> Option<OutF32Why> {
    let lora_on_o = if f.graph { f.graph_lora } else { f.lora_on_o };
    if lora_on_o {
        Some(OutF32Why::LoraOnO)
    } else if f.out16_unserved {
        Some(OutF32Why::Unserved)
    } else {
        None
    }
}

/// The plan for one layer of a step (see the module docs for each rule); the first reason that
/// applies, in the order of [`AttnF32Why`], names an f32 step. `q_kv` = the model's query and
/// key/value widths, which the traffic model prices.
pub fn attn16_plan(f: &Attn16Facts, q_kv: (usize, usize)) -> Attn16Plan {
    let why = if !f.switch_on {
        Some(AttnF32Why::Off)
    } else if !f.weights_16bit {
        Some(AttnF32Why::F32Weights)
    } else if f.rows == 0 {
        Some(AttnF32Why::NoRows)
    } else if f.gemv {
        Some(AttnF32Why::Gemv)
    } else if f.bias {
        Some(AttnF32Why::Bias)
    } else if f.rope_unserved {
        Some(AttnF32Why::RopeUnserved)
    } else {
        None
    };
    if let Some(w) = why {
        return Attn16Plan::F32(w);
    }
    // Only a path the step can take without its LoRA deltas, and only where the model says it
    // moves fewer bytes (linear in rows: one row prices the comparison).
    let need = attn16_path_needed(f);
    let (q, kv) = q_kv;
    let bytes = |p: AttnPath| attn16_traffic_bytes(p, 1, q, kv);
    match need {
        // The output 16-bit wherever nothing reads it in f32 and the family stores it (4q B a
        // row against 12q: the model never prefers the f32 output, the proptests check it).
        AttnPath::Attn16 { delta: false, .. } if bytes(need) <= bytes(AttnPath::F32) => {
            Attn16Plan::Attn16 {
                out: out16_blocker(f).map_or(Ok(()), Err),
            }
        }
        _ => Attn16Plan::F32(AttnF32Why::LoraOnQkv),
    }
}

/// Bytes of activations a step of `rows` rows moves between the q/k/v products, RoPE, the K/V
/// write, the attention output and o_proj's GEMM input on `path` (an [`Attn16Plan`]
/// converts), for query width `q` and key/value width `kv` (module docs, per element; weights,
/// `x`, the K/V cache writes, the attention kernels' q read and the LoRA kernels' own traffic,
/// the same on both paths, are not counted): what [`attn16_plan`] compares and
/// `cuda_bench --act16` divides by its time.
pub fn attn16_traffic_bytes(path: impl Into<AttnPath>, rows: usize, q: usize, kv: usize) -> usize {
    // The attention output: f32 written (4q), cast read (4q) and written (2q), GEMM read (2q);
    // or 16-bit written (2q) and read by the GEMM (2q).
    let out = |out16: bool| if out16 { 4 * q } else { 12 * q };
    let per_row = match path.into() {
        // q, k, v written f32 (4q + 8kv), read (4q + 8kv), q and k written back (4q + 4kv).
        AttnPath::F32 => 12 * q + 20 * kv + out(false),
        // q, k, v written 16-bit (2q + 4kv), read (2q + 4kv), q written f32 (4q); with the
        // delta its f32 scratch zeroed (4q + 8kv) and read (4q + 8kv).
        AttnPath::Attn16 { delta, out16 } => {
            8 * q + 8 * kv + if delta { 8 * q + 16 * kv } else { 0 } + out(out16)
        }
    };
    rows * per_row
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn facts() -> impl Strategy<Value = Attn16Facts> {
        (any::<[bool; 10]>(), prop_oneof![Just(0usize), 1usize..4096]).prop_map(|(b, rows)| {
            Attn16Facts {
                switch_on: b[0],
                weights_16bit: b[1],
                rows,
                lora_on_qkv: b[2],
                graph: b[3],
                graph_lora: b[4],
                gemv: b[5],
                bias: b[6],
                rope_unserved: b[7],
                lora_on_o: b[8],
                out16_unserved: b[9],
            }
        })
    }

    /// Query and key/value widths, GQA (kv ≤ q) or not.
    fn widths() -> impl Strategy<Value = (usize, usize)> {
        (1usize..64, 1usize..=8, 1usize..=8)
            .prop_map(|(hd, kvh, g)| (hd * 2 * kvh * g, hd * 2 * kvh))
    }

    /// Facts where every condition but the LoRA ones holds: the 16-bit path is on offer.
    fn on_offer(f: &Attn16Facts) -> bool {
        f.switch_on && f.weights_16bit && f.rows > 0 && !f.gemv && !f.bias && !f.rope_unserved
    }

    const LLAMA8B: (usize, usize) = (4096, 1024);

    #[test]
    fn lora_on_qkv_keeps_f32_and_a_graph_reads_its_key() {
        let mut f = Attn16Facts {
            switch_on: true,
            weights_16bit: true,
            rows: 32,
            ..Default::default()
        };
        let lora_f32 = Attn16Plan::F32(AttnF32Why::LoraOnQkv);
        let out16 = Attn16Plan::Attn16 { out: Ok(()) };
        assert_eq!(attn16_plan(&f, LLAMA8B), out16);
        f.lora_on_qkv = true;
        assert_eq!(attn16_plan(&f, LLAMA8B), lora_f32);
        f.graph = true;
        assert_eq!(attn16_plan(&f, LLAMA8B), out16);
        f.graph_lora = true;
        assert_eq!(attn16_plan(&f, LLAMA8B), lora_f32);
        f.bias = true;
        assert_eq!(attn16_plan(&f, LLAMA8B), Attn16Plan::F32(AttnF32Why::Bias));
        f.gemv = true;
        assert_eq!(attn16_plan(&f, LLAMA8B), Attn16Plan::F32(AttnF32Why::Gemv));
    }

    #[test]
    fn lora_on_o_or_an_unserved_family_keeps_the_output_f32() {
        let mut f = Attn16Facts {
            switch_on: true,
            weights_16bit: true,
            rows: 32,
            lora_on_o: true,
            ..Default::default()
        };
        let out_f32 = |w| Attn16Plan::Attn16 { out: Err(w) };
        assert_eq!(attn16_plan(&f, LLAMA8B), out_f32(OutF32Why::LoraOnO));
        f.graph = true;
        assert!(attn16_plan(&f, LLAMA8B).stores_out16());
        f.out16_unserved = true;
        assert_eq!(attn16_plan(&f, LLAMA8B), out_f32(OutF32Why::Unserved));
    }

    /// The figures the module docs quote for Llama-3-8B: the input half's 68 KiB (f32), 40 KiB
    /// (16-bit, 59 %) and 88 KiB (16-bit with the deltas) a row, plus the output's 48 KiB
    /// (f32) or 16 KiB (16-bit): 116, 88 and 56 KiB (48 %).
    #[test]
    fn the_figures_of_the_docs() {
        let b = |p: AttnPath| attn16_traffic_bytes(p, 1, LLAMA8B.0, LLAMA8B.1);
        let p16 = |delta, out16| AttnPath::Attn16 { delta, out16 };
        assert_eq!(b(AttnPath::F32), (68 + 48) * 1024);
        assert_eq!(b(p16(false, false)), (40 + 48) * 1024);
        assert_eq!(b(p16(false, true)), (40 + 16) * 1024);
        assert_eq!(b(p16(true, false)), (88 + 48) * 1024);
        assert_eq!(100 * b(p16(false, true)) / b(AttnPath::F32), 48);
    }

    proptest! {
        /// The 16-bit path runs exactly when every condition of the module docs holds and no
        /// LoRA targets q, k or v (a graph: its key has no rank class).
        #[test]
        fn sixteen_bit_exactly_when_every_condition_holds(f in facts(), w in widths()) {
            let lora = if f.graph { f.graph_lora } else { f.lora_on_qkv };
            let p = attn16_plan(&f, w);
            prop_assert_eq!(p.rounds_qkv(), on_offer(&f) && !lora);
            if on_offer(&f) && lora {
                prop_assert_eq!(p, Attn16Plan::F32(AttnF32Why::LoraOnQkv));
            }
        }

        /// Switched off, no fact matters: every step is the f32 path the backend ran before.
        #[test]
        fn off_is_always_the_f32_path(f in facts(), w in widths()) {
            let f = Attn16Facts { switch_on: false, ..f };
            prop_assert_eq!(attn16_plan(&f, w), Attn16Plan::F32(AttnF32Why::Off));
        }

        /// One performance model decides: wherever the 16-bit path is on offer, the chosen
        /// path never moves more bytes than the other path for the same facts (the f32 path,
        /// or the 16-bit path those facts would need).
        #[test]
        fn the_chosen_path_never_moves_more_bytes(f in facts(), w in widths()) {
            let f = Attn16Facts {
                switch_on: true,
                weights_16bit: true,
                rows: f.rows.max(1),
                gemv: false,
                bias: false,
                rope_unserved: false,
                ..f
            };
            let chosen = attn16_plan(&f, w);
            let others = match chosen {
                // The f32 path, and the 16-bit path with the other output wherever the facts
                // allow it (a 16-bit output the facts forbid is no alternative).
                Attn16Plan::Attn16 { out } => vec![
                    AttnPath::F32,
                    AttnPath::Attn16 { delta: false, out16: false },
                    AttnPath::Attn16 { delta: false, out16: out.is_ok() },
                ],
                Attn16Plan::F32(_) => vec![attn16_path_needed(&f)],
            };
            let c = attn16_traffic_bytes(chosen, f.rows, w.0, w.1);
            for other in others {
                let o = attn16_traffic_bytes(other, f.rows, w.0, w.1);
                prop_assert!(c <= o, "{:?} moves {} B, {:?} {} B", chosen, c, other, o);
            }
        }

        /// The output is stored 16-bit exactly where the q/k/v products are, no LoRA on o may
        /// read it (a graph: its key has no rank class) and the family has the store.
        #[test]
        fn out16_exactly_when_its_conditions_hold(f in facts(), w in widths()) {
            let lora_o = if f.graph { f.graph_lora } else { f.lora_on_o };
            let p = attn16_plan(&f, w);
            prop_assert_eq!(p.stores_out16(), p.rounds_qkv() && !lora_o && !f.out16_unserved);
            prop_assert!(!p.stores_out16() || p.rounds_qkv());
        }

        /// The output's facts never move the q/k/v rounding, the one decision the CPU
        /// emulation reads (`cpu_attn16.rs`: storing the output 16-bit changes no value o's
        /// product reads), so the emulation is the same with or without the 16-bit output.
        #[test]
        fn the_output_facts_never_change_the_qkv_rounding(
            f in facts(), w in widths(), o: bool, u: bool,
        ) {
            let g = Attn16Facts { lora_on_o: o, out16_unserved: u, ..f };
            prop_assert_eq!(attn16_plan(&f, w).rounds_qkv(), attn16_plan(&g, w).rounds_qkv());
        }

        /// o's LoRA (and the CPU-assist export of o's input) never reads a rounded value:
        /// wherever one may run, the attention output stays f32.
        #[test]
        fn o_lora_never_reads_a_rounded_output(f in facts(), w in widths()) {
            let lora_o = if f.graph { f.graph_lora } else { f.lora_on_o };
            if lora_o {
                prop_assert!(!attn16_plan(&f, w).stores_out16());
            }
        }

        /// In graph mode the plan never depends on the step's LoRA facts (a captured graph
        /// replays one path for every step of its bucket); out of graph mode it never depends
        /// on the key's rank class.
        #[test]
        fn a_graph_plan_never_reads_the_steps_lora_facts(f in facts(), w in widths(), a: bool) {
            let g = Attn16Facts { graph: true, ..f };
            prop_assert_eq!(attn16_plan(&g, w), attn16_plan(&Attn16Facts { lora_on_qkv: a, ..g }, w));
            prop_assert_eq!(attn16_plan(&g, w), attn16_plan(&Attn16Facts { lora_on_o: a, ..g }, w));
            let e = Attn16Facts { graph: false, ..f };
            prop_assert_eq!(attn16_plan(&e, w), attn16_plan(&Attn16Facts { graph_lora: a, ..e }, w));
        }

        /// Every LoRA that runs on q, k or v reads and adds to unrounded values: wherever one
        /// may run (eager: the step's adapters; graph: the key's rank class), the products stay
        /// f32.
        #[test]
        fn lora_reads_f32_where_it_needs_it(f in facts(), w in widths()) {
            let lora = if f.graph { f.graph_lora } else { f.lora_on_qkv };
            if lora {
                prop_assert!(!attn16_plan(&f, w).rounds_qkv());
            }
        }

        /// Without a delta the 16-bit path moves fewer bytes than the f32 path (20q + 8kv
        /// against 24q + 20kv), with the 16-bit output at most half (12q + 8kv); with a delta
        /// it moves more than f32.
        #[test]
        fn the_16_bit_path_moves_fewer_bytes_only_without_a_delta(
            rows in 1usize..4096, w in widths(), delta: bool, out16: bool,
        ) {
            // A step with deltas stores the output in f32 (attn16_path_needed).
            let out16 = out16 && !delta;
            let f32b = attn16_traffic_bytes(AttnPath::F32, rows, w.0, w.1);
            let b16 = attn16_traffic_bytes(AttnPath::Attn16 { delta, out16 }, rows, w.0, w.1);
            if delta {
                prop_assert!(b16 > f32b);
            } else if out16 {
                prop_assert!(2 * b16 <= f32b);
            } else {
                prop_assert!(b16 < f32b);
            }
        }
    }
}
