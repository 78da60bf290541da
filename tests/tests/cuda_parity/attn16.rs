//! The 16-bit attention inputs (a default, off: `THAW_CUDA_BF16_ACT=0`; `attn16.cu` + `attn16.rs`)
//! against the CPU oracle and the f32 path they replace: the `qkv_rope16` kernel alone (every
//! weight × KV dtype, GQA heads, 1 to 128 rows), whole engines (Llama, and Qwen2 whose q/k/v
//! biases keep the attention f32) eager and graph-captured, and steady decode steps' device
//! counts (eager and replayed); the attention output stored 16-bit (`attn_out.rs`): each
//! kernel family's 16-bit-output entries against its f32 entries. Part of `cuda_parity` (its
//! helpers, its GPU skip rules).
//!
//! Tolerances (normwise relative, `rel_err`):
//! - the kernel's rotated q (f32) against the CPU's `rope` over the same widened 16-bit q:
//!   1e-6 (the same f32 angle and f64 sincos; only FMA contraction may differ, an f32 ulp);
//! - its K and V cache rows against the CPU's rotated k and widened v (f32, unrounded): twice
//!   the KV dtype's unit roundoff (2⁻⁸ bf16, 2⁻¹⁰ f16: one rounding on the store, which an
//!   ulp of the rotation may move across a rounding boundary) plus the 1e-6, and 1e-6 for an
//!   f32 cache;
//! - the 16-bit-output entries: bit for bit `from_f32` of the f32 entries' output (they compute
//!   in f32 the same way and differ only in the store's rounding);
//! - engines: logits within the suite's 16-bit 1e-2 and identical greedy tokens at every step
//!   but at a near tie of the reference run (`gemv.rs`' rule), as `act16.rs`'s engines test.
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_kernels::cpu::KvLayout;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::{AttnImpl, CudaBackend, CudaConfig, DType};
use thaw_runtime::backend::Backend;
use thaw_server::gen::{ArchOptions, GenArch};
use thaw_tests::graphs::prompts;
use thaw_tests::{rel_err, test_preset, TestModel};

use super::act16::decode_logged;
use super::gemv::near_tie;
use super::graphs::engine_with;
use super::host_overhead::decode_counts_on;
use super::{check, classic_kernels, prefix_step, rand_vec, step_of};

/// The 16-bit bits of `v` in `dt`, and their f32 value.
fn round16(v: &[f32], dt: DType) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = v
        .iter()
        .map(|&x| match dt {
            DType::Bf16 => half::bf16::from_f32(x).to_bits(),
            DType::F16 => half::f16::from_f32(x).to_bits(),
            DType::F32 => unreachable!("16-bit types only"),
        })
        .collect();
    let vals = bits
        .iter()
        .map(|&b| match dt {
            DType::Bf16 => half::bf16::from_bits(b).to_f32(),
            _ => half::f16::from_bits(b).to_f32(),
        })
        .collect();
    (bits, vals)
}

/// One rounding into `kv` (the store; twice the unit roundoff), plus the f32 rotation's 1e-6.
fn kv_tol(kv: DType) -> f64 {
    1e-6 + match kv {
        DType::F32 => 0.0,
        DType::Bf16 => 1.0 / 256.0,
        DType::F16 => 1.0 / 1024.0,
    }
}

#[test]
fn qkv_rope16_matches_the_cpu_rope_and_kv_write() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    // GQA: 8 query heads over 2 KV heads of 64.
    let m = super::shape();
    let c = &m.config;
    assert!(c.num_heads > c.num_kv_heads, "a GQA shape");
    let (q_len, kv_len) = (c.q_dim(), c.kv_dim());
    let mut rng = ChaCha8Rng::seed_from_u64(2961);
    let mut cpu = CpuBackend::new(c);
    for w in [DType::Bf16, DType::F16] {
        for kv in [DType::F32, DType::Bf16, DType::F16] {
            let cfg = CudaConfig {
                weight_dtype: w,
                kv_dtype: kv,
                ..Default::default()
            };
            let mut g = CudaBackend::new(c, &cfg).expect("CUDA backend");
            g.set_act16(true).unwrap();
            for rows in [1usize, 3, 17, 128] {
                // Positions spread over a long context (large angles), not in order.
                let pos: Vec<usize> = (0..rows).map(|r| (r * 977 + 5) % 4096).collect();
                let (q16, mut q) = round16(&rand_vec(&mut rng, rows * q_len, 3.0), w);
                let (k16, mut k) = round16(&rand_vec(&mut rng, rows * kv_len, 3.0), w);
                let (v16, v) = round16(&rand_vec(&mut rng, rows * kv_len, 3.0), w);
                let [gq, gk, gv] = g.qkv_rope16_host([&q16, &k16, &v16], &pos).unwrap();
                cpu.rope(&mut q, &pos, c.num_heads);
                cpu.rope(&mut k, &pos, c.num_kv_heads);
                let what = |t: &str| format!("qkv_rope16 {w:?}/{kv:?} {rows} rows {t}");
                check(&what("q"), w, 1e-6, &gq, &q[..rows * q_len]);
                check(&what("K"), w, kv_tol(kv), &gk, &k[..rows * kv_len]);
                check(&what("V"), w, kv_tol(kv), &gv, &v);
            }
            g.check().unwrap();
        }
    }
}

/// The attention families `attention_x16` may launch, switched on `g` by name.
fn family(g: &mut CudaBackend, name: &str) -> bool {
    classic_kernels(g);
    match name {
        "classic" => true,
        "split" => {
            g.set_attn_impl(AttnImpl::Split { min_chunk: 4 }).unwrap();
            true
        }
        "occupancy" => {
            g.set_attn_occupancy(Some(4)).unwrap();
            true
        }
        // Served only with a cache of the weight dtype on an sm_80+ device.
        "tensor-core" => g.set_tc_prefill(true).unwrap(),
        _ => unreachable!("{name}"),
    }
}

/// Each attention family's 16-bit-output entries (`attn_decode_K_out_W`, the split reduce's,
/// the occupancy decode's, `attn_prefill_K_out_W`, the tensor-core prefill's) against its f32
/// entries over the same cache and queries: every output value bit for bit the f32 one rounded
/// to the weight dtype. Decode (contexts of 300: several splits) and prefill (a prompt that
/// continues a 40-position prefix) at 1, 3, 17 and 128 rows, bf16 and f16 weights, every KV
/// dtype the family takes.
#[test]
fn attention_16_bit_outputs_are_the_f32_outputs_rounded() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let c = super::shape().config;
    let qw = c.q_dim();
    let mut rng = ChaCha8Rng::seed_from_u64(2962);
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    for w in [DType::Bf16, DType::F16] {
        for kv in [DType::F32, DType::Bf16, DType::F16] {
            for name in ["classic", "split", "occupancy", "tensor-core"] {
                let cfg = CudaConfig {
                    weight_dtype: w,
                    kv_dtype: kv,
                    ..Default::default()
                };
                let mut g = CudaBackend::new(&c, &cfg).expect("CUDA backend");
                if !family(&mut g, name) || (name == "tensor-core" && kv != w) {
                    continue;
                }
                g.set_act16(true).unwrap();
                for rows in [1usize, 3, 17, 128] {
                    let decode = vec![(299, 1); rows];
                    let prefill = [(40, rows)];
                    for (kind, lens) in [("decode", &decode[..]), ("prefill", &prefill[..])] {
                        let (step, nb) = step_of(lens, 16);
                        let mut kvg = g.alloc_kv_layer(layout, nb).unwrap();
                        let mut outs = (Vec::new(), Vec::new());
                        for st in [&prefix_step(&step), &step] {
                            let n = st.rows();
                            let up = |g: &CudaBackend, v: Vec<f32>| g.upload_f32(&v).unwrap();
                            let q = up(&g, rand_vec(&mut rng, n * qw, 1.0));
                            let k = up(&g, rand_vec(&mut rng, n * c.kv_dim(), 1.0));
                            let v = up(&g, rand_vec(&mut rng, n * c.kv_dim(), 1.0));
                            let mut o32 = g.alloc(n * qw).unwrap();
                            let mut o16 = g.alloc_x16(n * qw).unwrap();
                            g.begin_step();
                            g.attention(&q, &k, &v, &mut kvg, st, &mut o32);
                            g.attention_x16((&q, &k, &v), &mut kvg, st, &mut o16)
                                .unwrap();
                            outs = (
                                g.download_f32(&o32, n * qw).unwrap(),
                                g.download_x16(&o16, n * qw).unwrap(),
                            );
                        }
                        let (f32s, got) = outs;
                        let (_, want) = round16(&f32s, w);
                        let differ = got
                            .iter()
                            .zip(&want)
                            .filter(|(a, b)| a.to_bits() != b.to_bits())
                            .count();
                        assert_eq!(
                            differ, 0,
                            "{name} {kind} {w:?}/{kv:?} {rows} rows: values not from_f32 of f32's"
                        );
                    }
                }
                g.check().unwrap();
                println!("{name} {w:?}/{kv:?}: 16-bit outputs bit for bit");
            }
        }
    }
}

/// Greedy decode runs of `tm` with the switch off, on (eager) and on with CUDA graphs (decode
/// steps of up to 16 rows), batches of 1, 3, 8 and 20 without an adapter and with rows on a
/// gate/up adapter (the MLP then stays f32: the attention's rounding alone, its output 16-bit),
/// on a q/v one (the attention stays f32) and on an o one (q/k/v 16-bit, the attention output
/// f32 for o's LoRA): each sequence's tokens identical and every step's logits within
/// 1e-2 of the reference run up to a near tie (see the module docs). Returns the worst logits
/// error of the on runs against off.
fn engines_agree(tm: &TestModel, dt: DType) -> f64 {
    let adapters = [
        tm.adapter(8, &["gate", "up"], 97),
        tm.adapter(8, &["q", "v"], 98),
        tm.adapter(8, &["o"], 99),
    ];
    let vocab = tm.model.config.vocab_size;
    let cases: [&[Option<u32>]; 4] = [
        &[None],
        &[None, Some(0)],
        &[None, Some(0), Some(1)],
        &[Some(2), None],
    ];
    let mut runs = Vec::new();
    for (on, graphs) in [(false, false), (true, false), (true, true)] {
        let mut e = engine_with(&tm.model, dt, &adapters, graphs, |g| {
            g.set_gemv(false).unwrap();
            g.set_act16(on).unwrap();
        });
        let (mut first, mut all) = (0, Vec::new());
        for pattern in cases.iter().chain(&cases) {
            for b in [1usize, 3, 8, 20] {
                let who: Vec<Option<u32>> = (0..b).map(|i| pattern[i % pattern.len()]).collect();
                let p = prompts(b, vocab, 700 + b as u64);
                all.extend(decode_logged(&mut e, first, &who, &p, 6));
                first += b as u64;
            }
        }
        if graphs {
            let s = e.graph_stats().cloned().expect("graphs on");
            assert_eq!(s.failed, 0, "{dt:?}: a capture with the switch on failed");
            assert!(s.replays > 0, "{dt:?}: no graph replayed");
        }
        runs.push(all);
    }
    let mut worst_on = 0.0f64;
    for (r, m, name) in [
        (0, 1, "eager on vs off"),
        (0, 2, "graphs on vs off"),
        (1, 2, "graphs vs eager, on"),
    ] {
        let (mut parted, mut worst) = (0, 0.0f64);
        for (i, (a, b)) in runs[r].iter().zip(&runs[m]).enumerate() {
            for s in 0..a.0.len() {
                let e = rel_err(&b.1[s], &a.1[s]);
                worst = worst.max(e);
                assert!(
                    e <= 1e-2,
                    "{dt:?} attn16 {name} seq {i} step {s}: rel err {e:e}"
                );
                if a.0[s] != b.0[s] {
                    assert!(
                        near_tie(&a.1[s]),
                        "{dt:?} attn16 {name} seq {i}: token of step {s} differs, no near tie"
                    );
                    parted += 1;
                    break;
                }
            }
        }
        println!("{dt:?} attn16 {name}: {parted} parted at a near tie; worst rel err {worst:.2e}");
        if r == 0 {
            worst_on = worst_on.max(worst);
        }
    }
    worst_on
}

#[test]
fn engines_with_16_bit_qkv_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let llama = TestModel::llama(8);
    let qwen2 = TestModel::with_arch(
        &test_preset(),
        24,
        ArchOptions {
            arch: GenArch::Qwen2,
            ..Default::default()
        },
    );
    for dt in [DType::Bf16, DType::F16] {
        let e = engines_agree(&llama, dt);
        assert!(e > 0.0, "{dt:?} Llama: the switch changed nothing");
        engines_agree(&qwen2, dt);
    }
}

/// A steady decode step with the switch on, three base rows (the attention's 16-bit path every
/// step), eager and graph-replayed: no allocation, every step alike. Eager, against the switch
/// off (classic RoPE, not folded): the same products, three launches fewer a layer (RoPE of q,
/// RoPE of k and the KV write become one `qkv_rope16`; the attention kernels store o_proj's
/// 16-bit input, so its cast goes). Replayed: one graph launch, no product
/// from the host (the 16-bit q/k/v scratch was reserved before the capture).
#[test]
fn steady_decode_with_16_bit_qkv_allocates_nothing() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let layers = tm.model.config.num_layers as u64;
    for dt in [DType::Bf16, DType::F16] {
        let mut eager = Vec::new();
        for on in [false, true] {
            let counts = decode_counts_on(&tm, dt, 3, (None, false), |g| {
                g.set_gemv(false).unwrap();
                g.set_act16(on).unwrap();
            });
            for c in &counts {
                assert_eq!(
                    (c.allocs, c.alloc_bytes),
                    (0, 0),
                    "{dt:?} on {on}: allocated"
                );
                assert_eq!(c, &counts[0], "{dt:?} on {on}: steps differ");
            }
            eager.push(counts[0]);
        }
        let (off, on) = (&eager[0], &eager[1]);
        println!("{dt:?} attn16 eager: off {off:?}, on {on:?}");
        assert_eq!(on.gemms, off.gemms, "{dt:?}: another number of products");
        assert_eq!(on.launches + 3 * layers, off.launches, "{dt:?}: launches");
        let counts = decode_counts_on(&tm, dt, 4, (None, true), |g| {
            g.set_gemv(false).unwrap();
            g.set_act16(true).unwrap();
        });
        for (k, c) in counts.iter().enumerate() {
            assert_eq!(
                (c.allocs, c.alloc_bytes),
                (0, 0),
                "{dt:?}: replay {k} allocated"
            );
            assert_eq!((c.graph_launches, c.gemms), (1, 0), "{dt:?}: replay {k}");
            assert_eq!(c, &counts[0], "{dt:?}: replay {k} differs");
        }
    }
}
