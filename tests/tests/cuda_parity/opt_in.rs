//! Issue 29's nine kernels that were opt-in until session 24's H200 run proved them (now the
//! defaults; `0` turns each off: `THAW_CUDA_WIDE_NORM`, `THAW_CUDA_ROPE_FOLD`,
//! `THAW_CUDA_GROUP_GEMM`, `THAW_CUDA_GEMV`, `THAW_CUDA_DEVICE_ARGMAX`, `THAW_CUDA_LORA_SLICES`,
//! `THAW_CUDA_ATTN_OCCUPANCY`, `THAW_CUDA_CUBLASLT`, `THAW_CUDA_BF16_ACT`; the GEMV's own tests
//! are in `gemv.rs`, the occupancy decode's in `attn_occupancy.rs`, cuBLASLt's in `lt.rs`, the
//! slices' in `lora_slices.rs`, the device argmax's in `argmax.rs`, the 16-bit activations' in
//! `act16.rs`, `attn16.rs` and `residual16.rs`) against the paths they replace: the wide
//! RMSNorm / add + RMSNorm / RoPE blocks, q/k/v and gate/up as one product over weights placed
//! as one matrix, RoPE folded into the KV write, and whole engines (eager and CUDA graphs)
//! with all nine (and the opt-in FA prefill, `THAW_CUDA_PREFILL_FA`, and one-launch small-batch
//! LoRA, `THAW_CUDA_LORA_SMALL`, whose own tests are in `prefill_fa.rs` and `lora_small.rs`)
//! on against all off, each set explicitly (`defaults::set_nine`), so the
//! comparison holds whatever the environment says (`benches/gpu/lease.sh` runs this module
//! with all nine `0`). Part of `cuda_parity` (its helpers, its GPU skip rules).
//!
//! Tolerances (normwise relative, `rel_err`):
//! - against the CPU twins: the suite's (f32 1e-4, bf16 1e-2);
//! - wide norms against the classic ones: 1e-6, f32 and bf16 alike — the same f32 operations
//!   but the row's sum of squares in another order (a few ulp of one scale factor per row);
//!   wide add + RMSNorm against residual add then wide RMSNorm: bit for bit (same sums, same
//!   order), as the classic pair;
//! - wide RoPE, and RoPE folded into the KV write, against `rope_f32`: 1e-6 (the same angle,
//!   sincos and products; only the compiler's FMA contraction may differ), attention after the
//!   fold: f32 1e-5, bf16 the suite's 1e-2 (a last-ulp change in a rotated k may round its bf16
//!   cache entry the other way);
//! - one product against three: 1e-5 — the same 16-bit (or f32) operands and f32 accumulation;
//!   cuBLAS may pick another kernel for the wider product, i.e. another summation order;
//! - engines: greedy tokens identical (but at a near tie with the GEMV or the 16-bit
//!   activations on: `gemv.rs`), logits within the suite's f32 1e-4 and, with 16-bit weights,
//!   2e-2: the bound of the whole 16-bit activation switch on the test models
//!   (`residual16_oracle.rs`; `residual16.rs`' engines use it too), which the nine switch
//!   beside kernels that only reorder f32 sums.
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_kernels::cpu::KvLayout;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::{CudaBackend, CudaLinear, DType};
use thaw_runtime::backend::{Backend, StepLayout};
use thaw_tests::TestModel;

use super::defaults::set_nine;
use super::gemv::{check_off_on, off_on_runs};
use super::{cfg, check, mixed_step, rand_vec, shape, CONFIGS};

fn refs(v: &[CudaLinear]) -> Vec<&CudaLinear> {
    v.iter().collect()
}

pub(super) fn bitwise(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn wide_norms_and_rope_match_cpu_and_the_classic_kernels() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    let mut rng = ChaCha8Rng::seed_from_u64(291);
    for (dt, tol) in CONFIGS {
        let mut cpu = CpuBackend::new(c);
        let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
        // The residual compared below is read back as f32: the 16-bit residual stream
        // (`THAW_CUDA_BF16_ACT=1`, private to the backend's residual ops) is not this test's.
        g.set_act16(false).unwrap();
        // The model's width, Llama-7B's (one float4 per thread of 1024), a width that needs
        // 3 float4 a thread, and one the wide kernel does not serve (the classic one runs).
        for (rows, d) in [(37, c.hidden_size), (1, 4096), (3, 12_288), (2, 4098)] {
            let x = rand_vec(&mut rng, rows * d, 2.0);
            let h = rand_vec(&mut rng, rows * d, 2.0);
            let w = rand_vec(&mut rng, d, 1.5);
            let mut want = vec![0.0; rows * d];
            cpu.rms_norm(&x, &w, 1e-5, rows, &mut want);
            let (mut hc, mut oc) = (h.clone(), vec![0.0; rows * d]);
            thaw_kernels::cpu::add_rms_norm(&mut hc, &x, &w, 1e-5, &mut oc);
            let wg = g.upload_vector(w).unwrap();
            let xg = g.upload_f32(&x).unwrap();
            let mut norms = Vec::new();
            let mut adds = Vec::new();
            for wide in [false, true] {
                g.set_wide(wide).unwrap();
                let mut og = g.alloc(rows * d).unwrap();
                g.rms_norm(&xg, &wg, 1e-5, rows, &mut og);
                let o = g.download_f32(&og, rows * d).unwrap();
                check(&format!("rms_norm d={d} wide={wide}"), dt, tol, &o, &want);
                norms.push(o);
                for fused in [false, true] {
                    g.set_fused(fused).unwrap();
                    let mut hg = g.upload_f32(&h).unwrap();
                    let mut og = g.alloc(rows * d).unwrap();
                    g.add_rms_norm(&mut hg, &xg, &wg, 1e-5, rows, d, &mut og);
                    let hr = g.download_f32(&hg, rows * d).unwrap();
                    let or = g.download_f32(&og, rows * d).unwrap();
                    let what = format!("add_rms_norm d={d} wide={wide} fused={fused}");
                    check(&format!("{what} residual"), dt, 1e-6, &hr, &hc);
                    check(&what, dt, tol, &or, &oc);
                    adds.push(or);
                }
            }
            check(
                &format!("rms_norm d={d} wide vs classic"),
                dt,
                1e-6,
                &norms[1],
                &norms[0],
            );
            // (classic unfused, classic fused, wide unfused, wide fused)
            assert!(
                bitwise(&adds[0], &adds[1]) && bitwise(&adds[2], &adds[3]),
                "{dt:?} d={d}: fused add + RMSNorm differs from add then RMSNorm"
            );
            check(
                &format!("add_rms_norm d={d} wide vs classic"),
                dt,
                1e-6,
                &adds[2],
                &adds[0],
            );
        }
        // RoPE: the model's heads and Llama-7B's (32 heads of 128), at large positions.
        for (rows, heads, hd) in [(37, c.num_heads, c.head_dim), (2, 32, 128)] {
            let mut mc = c.clone();
            mc.head_dim = hd;
            let mut cpu = CpuBackend::new(&mc);
            let mut g = CudaBackend::new(&mc, &cfg(dt)).expect("CUDA backend");
            let n = rows * heads * hd;
            let q = rand_vec(&mut rng, n, 1.0);
            let pos: Vec<usize> = (0..rows).map(|i| i * 997 + 3).collect();
            let mut want = q.clone();
            cpu.rope(&mut want, &pos, heads);
            let mut got = Vec::new();
            for wide in [false, true] {
                g.set_wide(wide).unwrap();
                g.begin_step();
                let mut rg = g.upload_f32(&q).unwrap();
                g.rope(&mut rg, &pos, heads);
                let r = g.download_f32(&rg, n).unwrap();
                check(
                    &format!("rope {heads}x{hd} wide={wide}"),
                    dt,
                    1e-5,
                    &r,
                    &want,
                );
                got.push(r);
            }
            println!(
                "rope {heads}x{hd}: wide bit for bit classic: {}",
                bitwise(&got[0], &got[1])
            );
            check(
                &format!("rope {heads}x{hd} wide vs classic"),
                dt,
                1e-6,
                &got[1],
                &got[0],
            );
        }
        g.check().unwrap();
    }
}

/// `linear_group` over `ws` (two or three weights) for `rows` rows of `x`; each output, downloaded.
fn group_outputs(
    g: &mut CudaBackend,
    x: &<CudaBackend as Backend>::Buf,
    ws: &[CudaLinear],
    rows: usize,
) -> Vec<Vec<f32>> {
    let mut ys: Vec<_> = ws
        .iter()
        .map(|w| g.alloc(rows * w.d_out).unwrap())
        .collect();
    match (ws, ys.as_mut_slice()) {
        ([q, k, v], [yq, yk, yv]) => g.linear_group(x, [q, k, v], rows, [yq, yk, yv]),
        ([a, b], [ya, yb]) => g.linear_group(x, [a, b], rows, [ya, yb]),
        _ => unreachable!("groups of two or three"),
    }
    ws.iter()
        .zip(&ys)
        .map(|(w, y)| g.download_f32(y, rows * w.d_out).unwrap())
        .collect()
}

/// q/k/v (GQA: k and v narrower) and gate/up: placed as one matrix with the switch on at load,
/// run as one product; against the same weights placed and run one by one.
#[test]
fn one_product_equals_one_per_module() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    assert!(c.num_kv_heads < c.num_heads, "the test shape is GQA");
    let h = c.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(292);
    let groups = [
        vec![c.q_dim(), c.kv_dim(), c.kv_dim()],
        vec![c.intermediate_size, c.intermediate_size],
    ];
    for (dt, _) in CONFIGS {
        let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
        for outs in &groups {
            let mats: Vec<Vec<f32>> = outs
                .iter()
                .map(|&d_out| rand_vec(&mut rng, d_out * h, 0.1))
                .collect();
            let host =
                |i: usize| thaw_kernels::cpu::WeightMatrix::from_f32(mats[i].clone(), outs[i], h);
            g.set_group_gemm(false).unwrap();
            let apart = g
                .upload_weight_group((0..outs.len()).map(|i| (host(i), None)).collect())
                .unwrap();
            g.set_group_gemm(true).unwrap();
            let one = g
                .upload_weight_group((0..outs.len()).map(|i| (host(i), None)).collect())
                .unwrap();
            assert!(CudaBackend::placed_as_one(&refs(&one)), "{dt:?} {outs:?}");
            assert!(
                !CudaBackend::placed_as_one(&refs(&apart)),
                "{dt:?} {outs:?}"
            );
            // 1, 5, 37 rows: one product; 200 (above GROUP_GEMM_MAX_ROWS): one cast, a
            // product per module over the views of the one matrix.
            for rows in [1, 5, 37, 200] {
                let x = rand_vec(&mut rng, rows * h, 2.0);
                let xg = g.upload_f32(&x).unwrap();
                // Off: one product per module.
                g.set_group_gemm(false).unwrap();
                let mut want = Vec::new();
                for (w, &d_out) in apart.iter().zip(outs) {
                    let mut y = g.alloc(rows * d_out).unwrap();
                    g.linear(&xg, w, rows, &mut y);
                    want.push(g.download_f32(&y, rows * d_out).unwrap());
                }
                // On: the same weights placed as one matrix, one product (or, past
                // GROUP_GEMM_MAX_ROWS, one per module over its range of the matrix).
                g.set_group_gemm(true).unwrap();
                let got = group_outputs(&mut g, &xg, &one, rows);
                for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                    let what = format!("group {outs:?} rows {rows} module {i}");
                    check(&what, dt, 1e-5, got, want);
                }
                // Placed apart, the switch on: one cast of x, a product per module.
                let got = group_outputs(&mut g, &xg, &apart, rows);
                for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        bitwise(got, want),
                        "{dt:?} {outs:?} rows {rows} module {i}: one cast changed a product"
                    );
                }
            }
        }
        g.check().unwrap();
    }
}

/// A mixed step (prefill chunks and decodes) through `rope_attention` with RoPE folded into
/// the KV write, against RoPE then attention: the attention output, the rotated q and k, and
/// (through a second step that reads them) the cache entries.
#[test]
fn rope_folded_into_the_kv_write_equals_rope_then_attention() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    let (step, nb) = mixed_step(8);
    // The second step decodes one more position of every sequence.
    let mut next = StepLayout::default();
    for s in &step.seqs {
        let r = next.token_ids.len();
        next.seqs.push(thaw_runtime::backend::SeqSlice {
            rows: r..r + 1,
            start_pos: s.start_pos + s.rows.len(),
            blocks: s.blocks.clone(),
        });
        next.token_ids.push(1);
        next.positions.push(s.start_pos + s.rows.len());
    }
    next.block_tables = step.block_tables.clone();
    let layout = KvLayout {
        block_size: 8,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    let (qw, kw) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let heads = (c.num_heads, c.num_kv_heads);
    for (dt, tol) in CONFIGS {
        let tol = if dt == DType::F32 { 1e-5 } else { tol };
        let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
        for fold in [false, true] {
            let mut rng = ChaCha8Rng::seed_from_u64(293);
            let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
            g.set_rope_fold(fold).unwrap();
            let mut kv = g.alloc_kv_layer(layout, nb + 2).unwrap();
            let mut outs = Vec::new();
            for st in [&step, &next] {
                let n = st.rows();
                let mut q = g.upload_f32(&rand_vec(&mut rng, n * qw, 1.0)).unwrap();
                let mut k = g.upload_f32(&rand_vec(&mut rng, n * kw, 1.0)).unwrap();
                let v = g.upload_f32(&rand_vec(&mut rng, n * kw, 1.0)).unwrap();
                let mut o = g.alloc(n * qw).unwrap();
                g.begin_step();
                g.rope_attention((&mut q, &mut k, &v), heads, &mut kv, st, &mut o);
                outs.push(g.download_f32(&o, n * qw).unwrap());
                outs.push(g.download_f32(&q, n * qw).unwrap());
                outs.push(g.download_f32(&k, n * kw).unwrap());
            }
            g.check().unwrap();
            runs.push(outs);
        }
        let names = ["out", "rotated q", "rotated k"];
        for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
            let what = format!("fold step {} {}", i / 3, names[i % 3]);
            let t = if i % 3 == 0 { tol } else { 1e-6 };
            check(&what, dt, t, b, a);
        }
    }
}

/// Whole engines, all nine off (eager) against all nine on (eager, and with CUDA graphs; the
/// 16-bit activations with 16-bit weights only): identical greedy tokens (but at near ties)
/// for batches with no adapter, a rank-8 adapter on q,v and a rank-32 adapter on every
/// projection (LoRA deltas added per module after the one product).
#[test]
fn engines_with_every_opt_in_switch_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let adapters = [
        tm.adapter(8, &["q", "v"], 82),
        tm.adapter(32, &["q", "k", "v", "o", "gate", "up", "down"], 83),
    ];
    let vocab = tm.model.config.vocab_size;
    let steps = 5;
    let batches = [1, 3, 8, 20];
    let who = |b: usize| -> Vec<Option<u32>> {
        (0..b).map(|i| [None, Some(0), Some(1)][i % 3]).collect()
    };
    for (dt, tol) in CONFIGS {
        // The GEMV multiplies f32 activations where cuBLAS multiplies their 16-bit rounding,
        // the 16-bit activations round them: tokens may part at a near tie (`gemv.rs`),
        // nowhere else.
        let x16 = dt != DType::F32;
        // The opt-in FA prefill switched with them (`prefill_fa.rs` has its own tests; with an
        // f32 cache it is not loaded and the classic prefill runs).
        let all = |g: &mut CudaBackend, on: bool| {
            set_nine(g, on, x16);
            g.set_prefill_fa(on).unwrap();
            g.set_lora_small(on).unwrap();
        };
        let runs = off_on_runs(&tm.model, dt, &adapters, &batches, who, steps, 200, all);
        let tol = if x16 { 2e-2 } else { tol };
        check_off_on(
            "all nine, the FA prefill and the small LoRA",
            dt,
            tol,
            &runs,
            vocab,
        );
    }
}
