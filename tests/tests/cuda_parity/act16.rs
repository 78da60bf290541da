//! The 16-bit MLP activations (a default, off: `THAW_CUDA_BF16_ACT=0`; `act16.cu` + `act16.rs`) against
//! the CPU oracle and the f32 path they replace: the SwiGLU kernel alone (with and without its
//! f32 copy), the gate/up → SwiGLU → down block with LoRA rows on down mixed with base rows
//! (16-bit) and with LoRA on gate/up (f32: `act16_plan` keeps it, the 16-bit path with the
//! deltas would move more bytes), whole engines eager and graph-captured, and steady decode
//! steps' device counts (eager and replayed). Part of `cuda_parity` (its helpers, its GPU skip
//! rules).
//!
//! Tolerances (normwise relative, `rel_err`, unless stated; DESIGN §9):
//! - `swiglu16_T` against the CPU (`silu(g)·u` in f32 over the same 16-bit inputs, then
//!   `half`'s round to nearest even): the 16-bit output within one unit in the last place of
//!   the CPU's rounding (the device's `expf` may differ from Rust's `exp` by an f32 ulp, which
//!   can move a value across a 16-bit rounding boundary), and at most 1% of elements off by
//!   that unit; the f32 copy within 1e-6 (a few f32 ulps);
//! - the block, switch on against off and against the CPU emulation (`CpuBackend::set_act16`):
//!   the suite's 16-bit 1e-2 (bf16 rounding, 2^-9 relative, of gate's and up's products and
//!   SwiGLU's output); with LoRA on gate/up the switch on is the f32 path bit for bit;
//! - engines: logits within 1e-2 and identical greedy tokens at every step, the prefill's
//!   included, but at a near tie of the reference run (`gemv.rs`' rule): the switch off for
//!   the on runs, the eager on run for the graph-captured one.
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::{LoraAdapter, LoraModule};
use thaw_runtime::backend::act16_plan::{Act16Plan, F32Why};
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::{CudaBackend, CudaLora, DType};
use thaw_runtime::backend::{
    Act16Type, Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout, LoraSite,
};
use thaw_runtime::engine::{Engine, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, LayerIdx, SeqId};
use thaw_runtime::sampling::SamplingParams;
use thaw_server::gen::ModelPreset;
use thaw_tests::graphs::prompts;
use thaw_tests::rel_err;
use thaw_tests::{test_preset, TestModel};

use super::gemv::near_tie;
use super::graphs::engine_with;
use super::host_overhead::{decode_counts_on, decode_counts_with};
use super::opt_in::bitwise;
use super::{cfg, check, mixed_lora_layout, rand_vec};

pub(super) const X16: [(DType, Act16Type); 2] =
    [(DType::Bf16, Act16Type::Bf16), (DType::F16, Act16Type::F16)];

/// The 16-bit bits of `v` in `dt`, and their f32 value.
pub(super) fn bits(v: f32, dt: DType) -> u16 {
    match dt {
        DType::Bf16 => half::bf16::from_f32(v).to_bits(),
        DType::F16 => half::f16::from_f32(v).to_bits(),
        DType::F32 => unreachable!("16-bit types only"),
    }
}

pub(super) fn value(b: u16, dt: DType) -> f32 {
    match dt {
        DType::Bf16 => half::bf16::from_bits(b).to_f32(),
        DType::F16 => half::f16::from_bits(b).to_f32(),
        DType::F32 => unreachable!("16-bit types only"),
    }
}

/// Units in the last place between two finite 16-bit values of one sign (bit distance).
fn ulps(a: u16, b: u16) -> u32 {
    let key = |x: u16| -> i32 {
        let m = (x & 0x7fff) as i32;
        if x & 0x8000 != 0 {
            -m
        } else {
            m
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

#[test]
fn swiglu16_matches_the_cpu_within_one_16_bit_ulp() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = super::shape();
    let mut rng = ChaCha8Rng::seed_from_u64(2960);
    for (dt, _) in X16 {
        let mut g = CudaBackend::new(&m.config, &cfg(dt)).expect("CUDA backend");
        g.set_act16(true).unwrap();
        // n a multiple of 4 (the vector path) and not (the scalar one); values over SiLU's
        // range (|g| up to 8: both tails and the bend).
        for n in [4096, 11008 * 3, 1001, 7] {
            let gate: Vec<u16> = rand_vec(&mut rng, n, 8.0)
                .iter()
                .map(|&v| bits(v, dt))
                .collect();
            let up: Vec<u16> = rand_vec(&mut rng, n, 4.0)
                .iter()
                .map(|&v| bits(v, dt))
                .collect();
            for copy in [false, true] {
                let want32: Vec<f32> = (0..n)
                    .map(|i| {
                        let (x, y) = (value(gate[i], dt), value(up[i], dt));
                        x / (1.0 + (-x).exp()) * y
                    })
                    .collect();
                let want16: Vec<u16> = want32.iter().map(|&v| bits(v, dt)).collect();
                let (got16, got32) = g.swiglu16_host(&gate, &up, copy).unwrap();
                let off: Vec<u32> = got16
                    .iter()
                    .zip(&want16)
                    .map(|(&a, &b)| ulps(a, b))
                    .collect();
                let worst = off.iter().copied().max().unwrap_or(0);
                let moved = off.iter().filter(|&&u| u > 0).count();
                println!("{dt:?} swiglu16 n {n} copy {copy}: worst {worst} ulp, {moved} moved");
                assert!(
                    worst <= 1,
                    "{dt:?} n {n}: a 16-bit output {worst} ulps off the CPU's"
                );
                assert!(
                    moved * 100 <= n.max(100),
                    "{dt:?} n {n}: {moved} outputs moved"
                );
                match got32 {
                    Some(v) => {
                        let what = format!("swiglu16 f32 copy n {n}");
                        check(&what, dt, 1e-6, &v, &want32)
                    }
                    None => assert!(!copy, "the f32 copy was asked for"),
                }
            }
        }
        g.check().unwrap();
    }
}

/// SmolLM2-135M's MLP (576 → 1536 → 576), one layer.
fn mlp_preset() -> ModelPreset {
    ModelPreset {
        name: "act16-mlp",
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 1,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        ..test_preset()
    }
}

fn site(c: &thaw_runtime::model::ModelConfig, m: LoraModule) -> LoraSite {
    let (d_in, d_out) = c.module_shape(m);
    LoraSite {
        layer: LayerIdx(0),
        module: m,
        dims: LinearDims { d_in, d_out },
    }
}

/// `down(gated_mlp_in(x))` with LoRA on `b`: what one layer's MLP block computes.
#[allow(clippy::too_many_arguments)]
fn block<B: Backend>(
    b: &mut B,
    c: &thaw_runtime::model::ModelConfig,
    w: &[B::Linear; 3],
    x: &B::Buf,
    rows: usize,
    batch: &LoraBatch<'_, B::Lora>,
) -> B::Buf {
    let inter = c.intermediate_size;
    let mut gate = b.alloc(rows * inter).unwrap();
    let mut up = b.alloc(rows * inter).unwrap();
    let mut act = b.alloc(rows * inter).unwrap();
    let mut out = b.alloc(rows * c.hidden_size).unwrap();
    let sites = [site(c, LoraModule::Gate), site(c, LoraModule::Up)];
    let outs = [&mut gate, &mut up];
    b.gated_mlp_in(x, [&w[0], &w[1]], rows, outs, sites, batch, &mut act);
    let down = [site(c, LoraModule::Down)];
    b.linear_group_lora(&act, [&w[2]], rows, [&mut out], down, batch);
    out
}

#[test]
fn the_mlp_block_with_16_bit_activations_matches_f32_and_the_cpu_emulation() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::from_preset(&mlp_preset(), 296);
    let c = tm.model.config.clone();
    // Rank 16 on gate/up/down, rank 8 on down only, rank 32 on q/v only (no MLP module).
    let adapters: Vec<Arc<LoraAdapter>> = vec![
        tm.adapter(16, &["gate", "up", "down"], 297),
        tm.adapter(8, &["down"], 298),
        tm.adapter(32, &["q", "v"], 299),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(2961);
    for (dt, ty) in X16 {
        let mut cpu = CpuBackend::new(&c);
        cpu.set_act16(Some(ty));
        let mut g = CudaBackend::new(&c, &cfg(dt)).expect("CUDA backend");
        g.set_gemv(false).unwrap();
        let mods = [LoraModule::Gate, LoraModule::Up, LoraModule::Down];
        let (wc, wg): (Vec<_>, Vec<_>) = mods
            .iter()
            .map(|&m| {
                let (d_in, d_out) = c.module_shape(m);
                let scale = 2.0 / (d_in as f32).sqrt();
                let w: Vec<f32> = rand_vec(&mut rng, d_out * d_in, scale)
                    .iter()
                    .map(|&v| value(bits(v, dt), dt))
                    .collect();
                let lc = cpu.upload_linear(w.clone(), d_out, d_in, None).unwrap();
                (lc, g.upload_linear(w, d_out, d_in, None).unwrap())
            })
            .unzip();
        let wc: [_; 3] = wc.try_into().ok().unwrap();
        let wg: [_; 3] = wg.try_into().ok().unwrap();
        let lc: Vec<_> = adapters
            .iter()
            .map(|a| cpu.upload_lora(a.clone()).unwrap())
            .collect();
        let lg: Vec<CudaLora> = adapters
            .iter()
            .map(|a| g.upload_lora(a.clone()).unwrap())
            .collect();
        for l in &lg {
            g.wait_landed(l, std::time::Duration::from_secs(120))
                .unwrap();
        }
        let (rc, rg): (Vec<_>, Vec<&CudaLora>) = (lc.iter().collect(), lg.iter().collect());
        for rows in [1, 32, 128, 2048] {
            let x = rand_vec(&mut rng, rows * c.hidden_size, 1.0);
            let xg = g.upload_f32(&x).unwrap();
            // Which adapters the step's rows use (index into `adapters`; none = base rows).
            let cases: [(&str, &[u32]); 4] = [
                ("base", &[]),
                ("lora on q/v and down", &[1, 2]),
                ("lora on gate/up/down", &[0, 1, 2]),
                ("lora on gate/up/down only", &[0]),
            ];
            for (what, pick) in cases {
                let layout = subset_layout(&mut rng, rows, pick);
                let landed = vec![99; adapters.len()];
                let bc = LoraBatch {
                    kernel: LoraKernel::Sgmv,
                    layout: &layout,
                    adapters: &rc,
                    landed: &landed,
                };
                let bg = bc.with_adapters(&rg);
                let want = block(&mut cpu, &c, &wc, &x, rows, &bc);
                let mut got = Vec::new();
                for on in [false, true] {
                    g.set_act16(on).unwrap();
                    g.begin_step();
                    let y = block(&mut g, &c, &wg, &xg, rows, &bg);
                    g.check().unwrap();
                    got.push(g.download_f32(&y, rows * c.hidden_size).unwrap());
                }
                let sites = [site(&c, LoraModule::Gate), site(&c, LoraModule::Up)];
                let plan = g.act16_plan_for([&wg[0], &wg[1]], rows, &sites, &bg);
                let label = format!("{dt:?} rows {rows} {what} ({plan:?})");
                // Adapter 0 targets gate/up (and down), adapters 0 and 1 down.
                let on = |w: &[u32]| layout.segments.iter().any(|(_, a)| w.contains(a));
                // LoRA on gate/up keeps f32 (more bytes on the 16-bit path); on down only, the
                // 16-bit path with the f32 copy.
                let want_plan = if on(&[0]) {
                    Act16Plan::F32(F32Why::LoraOnGateUp)
                } else {
                    Act16Plan::Act16 { f32_copy: on(&[1]) }
                };
                assert_eq!(plan, want_plan, "{label}: the plan");
                check(&format!("{label} on vs cpu"), dt, 1e-2, &got[1], &want);
                if plan.rounds_gate_up() {
                    check(&format!("{label} on vs off"), dt, 1e-2, &got[1], &got[0]);
                    assert!(
                        !bitwise(&got[1], &got[0]),
                        "{label}: the 16-bit path did not run"
                    );
                } else {
                    assert!(
                        bitwise(&got[1], &got[0]),
                        "{label}: the f32 path with the switch on differs from off"
                    );
                }
            }
        }
        g.check().unwrap();
    }
}

/// Segments of 1–8 rows on the adapters of `pick` in turn with base rows between them (every
/// row a base row when `pick` is empty); mixes base and adapter rows as `mixed_lora_layout`.
fn subset_layout(rng: &mut ChaCha8Rng, rows: usize, pick: &[u32]) -> LoraLayout {
    if pick.is_empty() {
        return LoraLayout {
            segments: Vec::new(),
            row_adapter: vec![None; rows],
        };
    }
    let mut l = mixed_lora_layout(rng, rows, pick.len() as u32);
    for (_, a) in &mut l.segments {
        *a = pick[*a as usize];
    }
    for a in l.row_adapter.iter_mut().flatten() {
        *a = pick[*a as usize];
    }
    if l.segments.is_empty() {
        // One row at least on the first pick, so the case tests what it names.
        l.segments.push((0..1, pick[0]));
        l.row_adapter[0] = Some(pick[0]);
    }
    l
}

/// Greedy tokens and every step's logits (the prefill's first) of sequences `first..` with
/// `prompts` on adapters `who`: one prefill step of them all, then `steps` decode steps.
pub(super) fn decode_logged(
    e: &mut Engine<CudaBackend>,
    first: u64,
    who: &[Option<u32>],
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<Logged> {
    let ids: Vec<SeqId> = (0..who.len() as u64).map(|i| SeqId(first + i)).collect();
    for ((&id, a), p) in ids.iter().zip(who).zip(prompts) {
        let params = SequenceParams {
            prompt: p.clone(),
            adapter: a.map(AdapterId),
            sampling: SamplingParams::greedy(),
            max_new_tokens: steps + 1,
            ignore_eos: true,
            ..Default::default()
        };
        e.add_sequence(id, params).unwrap();
    }
    let mut out = vec![(Vec::new(), Vec::new()); who.len()];
    for s in 0..=steps {
        let items = ids
            .iter()
            .zip(prompts)
            .map(|(&seq, p)| PlanItem {
                seq,
                num_tokens: if s == 0 { p.len() } else { 1 },
            })
            .collect();
        let plan = StepPlan {
            items,
            return_logits: true,
        };
        for o in e.step(&plan).unwrap() {
            let (t, l) = &mut out[(o.seq.0 - first) as usize];
            t.push(o.token.id);
            l.push(o.logits.expect("return_logits"));
        }
    }
    out
}

/// Whole engines, the switch off against on, eager and with CUDA graphs (decode steps of up to
/// 16 rows captured and replayed; the key's rank class decides: without one the 16-bit path,
/// with one f32): batches of 1, 3, 8 and 20 with no adapter, with rows on a q/v/down adapter
/// (eager: the 16-bit path with the f32 copy), and with those and rows on an every-projection
/// one (LoRA on gate/up: f32) mixed with base rows, each pattern twice (the second time every
/// graph replays). Each
/// sequence's greedy tokens are identical and each step's logits within 1e-2 — the on runs
/// against off, the graph-captured on run against the eager on run — up to a step where the
/// reference run's top two logits are a near tie (`gemv.rs`' `near_tie`): the rounding may
/// swap those two, the contexts part there, and the sequence is compared no further. The
/// prefill's token counts as a step (its logits are kept here).
#[test]
fn engines_with_16_bit_mlp_activations_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(8);
    let adapters = [
        tm.adapter(8, &["q", "v", "down"], 95),
        tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 96),
    ];
    let vocab = tm.model.config.vocab_size;
    let cases: [(&str, &[Option<u32>]); 3] = [
        ("base", &[None]),
        ("down", &[None, Some(0)]),
        ("mixed", &[None, Some(0), Some(1)]),
    ];
    for (dt, _) in X16 {
        let mut runs = Vec::new();
        for (on, graphs) in [(false, false), (true, false), (true, true)] {
            let mut e = engine_with(&tm.model, dt, &adapters, graphs, |g| {
                g.set_gemv(false).unwrap();
                g.set_act16(on).unwrap();
            });
            let mut first = 0;
            let mut all = Vec::new();
            for (_, pattern) in cases.iter().chain(&cases) {
                for b in [1usize, 3, 8, 20] {
                    let who: Vec<Option<u32>> =
                        (0..b).map(|i| pattern[i % pattern.len()]).collect();
                    let p = prompts(b, vocab, 500 + b as u64);
                    all.extend(decode_logged(&mut e, first, &who, &p, 6));
                    first += b as u64;
                }
            }
            if graphs {
                let s = e.graph_stats().cloned().expect("graphs on");
                println!("{dt:?} act16 graphs: {s:?}");
                assert_eq!(s.failed, 0, "{dt:?}: a capture with the switch on failed");
                assert!(s.replays > 0, "{dt:?}: no graph replayed");
            }
            runs.push(all);
        }
        compare_logged(&format!("{dt:?} act16"), &runs, 1e-2);
    }
}

/// One sequence's greedy tokens and each step's logits, as [`decode_logged`] keeps them.
pub(super) type Logged = (Vec<u32>, Vec<Vec<f32>>);

/// Logged runs (`decode_logged`: each sequence's greedy tokens and every step's logits, the
/// prefill's included) of the switch off, on eager and on with graphs, compared pairwise: on
/// eager vs off, on graphs vs off, on graphs vs on eager. Each step's logits within `tol`, and
/// the greedy tokens identical up to a step where the reference run's top two logits are a near
/// tie (`gemv.rs`' `near_tie`): the rounding may swap those two, the contexts part there, and
/// the sequence is compared no further.
pub(super) fn compare_logged(label: &str, runs: &[Vec<Logged>], tol: f64) {
    let pairs = [
        (0, 1, "on, eager vs off"),
        (0, 2, "on, graphs vs off"),
        (1, 2, "on, graphs vs on, eager"),
    ];
    for (r, m, name) in pairs {
        let (mut parted, mut worst) = (0, 0.0f64);
        for (i, (off, on)) in runs[r].iter().zip(&runs[m]).enumerate() {
            for s in 0..off.0.len() {
                let e = rel_err(&on.1[s], &off.1[s]);
                worst = worst.max(e);
                assert!(e <= tol, "{label} {name} seq {i} step {s}: rel err {e:e}");
                if on.0[s] != off.0[s] {
                    assert!(
                        near_tie(&off.1[s]),
                        "{label} {name} seq {i}: greedy token of step {s} differs ({} vs {}) and \
                         the step is not a near tie",
                        off.0[s],
                        on.0[s]
                    );
                    parted += 1;
                    break;
                }
            }
        }
        println!(
            "{label} {name}: {} sequences, {parted} parted at a near tie, the rest the same \
             tokens; worst logits rel err {worst:.2e}",
            runs[r].len()
        );
    }
}

/// A steady eager decode step (two rows on a q/v adapter: the attention half keeps f32) with
/// the switch on allocates nothing and launches the kernels and products of the switch off: the
/// fused norm's 16-bit copy serves gate and up (no cast), `swiglu16` replaces `swiglu_x16`,
/// down reads its output without a cast.
#[test]
fn steady_decode_with_16_bit_mlp_activations_allocates_nothing() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let mut per_switch = Vec::new();
    for on in [false, true] {
        let counts = decode_counts_with(&tm, DType::Bf16, 3, |b| {
            b.set_gemv(false).unwrap();
            b.set_act16(on).unwrap();
        });
        println!("act16 {on}: {:?}", counts[0]);
        for c in &counts {
            assert_eq!(
                (c.allocs, c.alloc_bytes),
                (0, 0),
                "act16 {on}: a decode step allocated"
            );
            assert_eq!(c, &counts[0], "act16 {on}: steps differ");
        }
        per_switch.push(counts[0]);
    }
    let (off, on) = (&per_switch[0], &per_switch[1]);
    // Two of the three rows are on a q/v adapter (`decode_counts_with`): the attention half
    // keeps f32 (`attn16_plan`: LoRA on q/k/v), and the MLP and residual halves launch one
    // kernel for each they replace. (Without LoRA the attention half launches three fewer a
    // layer: `attn16.rs`' steady test.) Seen on an H200: 30 and 30.
    assert_eq!(
        (on.launches, on.gemms),
        (off.launches, off.gemms),
        "the 16-bit path launched another number of kernels or products"
    );
}

/// A steady graph-replayed decode step with the switch on — three rows, base only (a key
/// without a rank class: the 16-bit path in every replay), then two of them on an adapter of
/// every projection (a key with one: f32) — allocates nothing and runs as one graph launch, no
/// product issued from the host, every replay alike: the 16-bit scratch was reserved before
/// the capture and the replay reuses it.
#[test]
fn steady_graph_decode_with_16_bit_mlp_activations_allocates_nothing() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let adapter = tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 91);
    for (dt, _) in X16 {
        for a in [None, Some(adapter.clone())] {
            let lora = a.is_some();
            let counts = decode_counts_on(&tm, dt, 4, (a, true), |g| {
                g.set_gemv(false).unwrap();
                g.set_act16(true).unwrap();
            });
            for (k, c) in counts.iter().enumerate() {
                println!("{dt:?} lora {lora} act16 graph replay {k}: {c:?}");
                assert_eq!(
                    (c.allocs, c.alloc_bytes),
                    (0, 0),
                    "{dt:?} lora {lora}: a replay allocated"
                );
                assert_eq!(
                    (c.graph_launches, c.gemms),
                    (1, 0),
                    "{dt:?} lora {lora}: a steady graph step is one graph launch, no product \
                     from the host"
                );
                assert_eq!(c, &counts[0], "{dt:?} lora {lora}: replay {k} differs");
            }
        }
    }
}

#[test]
fn act16_needs_16_bit_weights() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = super::shape();
    let mut g = CudaBackend::new(&m.config, &cfg(DType::F32)).expect("CUDA backend");
    let e = g.set_act16(true).unwrap_err().to_string();
    assert!(
        e.contains("THAW_CUDA_BF16_ACT") && e.contains("bf16"),
        "{e}"
    );
    assert!(!g.act16());
}
