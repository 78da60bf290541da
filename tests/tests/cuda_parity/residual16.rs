//! The 16-bit residual stream (a default, off: `THAW_CUDA_BF16_ACT=0`; `residual16.cu` + `residual16.rs`)
//! against the CPU oracle (`CpuBackend::set_act16`, `cpu_residual16.rs`: f32 add, the dtype's
//! round to nearest even, `cpu::rms_norm`) and against the switch off. Tolerances:
//! - `add_rms_norm_h16_T`'s stored residual: bit for bit the CPU's (one f32 add of the same
//!   values, one round to nearest even); its f32 output within 1e-5 normwise (the f32 block
//!   sum against the CPU's f64 sum, as norm.cu's parity); its 16-bit copy within one unit in
//!   the last place of the CPU's output rounded (the output's last-bit difference may cross a
//!   rounding boundary); `rms_norm_h16_T` likewise; embed + gather exactly the 16-bit table's
//!   rows;
//! - engines: the switch on against off, eager and with CUDA graphs, greedy tokens identical
//!   (but at near ties, `gemv.rs`' `same_greedy_tokens`) and logits within 2e-2 (the CPU
//!   oracle's bound for the whole switch on the test models, `residual16_oracle.rs`); graph
//!   steps against eager ones with the switch on within 1e-2;
//! - a steady decode step with the switch on allocates nothing and launches what the switch
//!   off launches (two rows on a q/v adapter keep the attention half f32); a steady graph
//!   replay is one graph launch.
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::CudaBackend;
use thaw_runtime::backend::Backend;
use thaw_server::gen::{ArchOptions, GenArch};
use thaw_tests::graphs::prompts;
use thaw_tests::{rel_err, test_preset, TestModel};

use super::act16::{bits, compare_logged, decode_logged, value, X16};
use super::gemv::rounded;
use super::graphs::engine_with;
use super::host_overhead::{decode_counts_on, decode_counts_with};
use super::{cfg, rand_vec};

/// `residual16.cu`'s kernels against the CPU backend's emulation of the switch
/// (`CpuBackend::set_act16`: the same add, rounding and norm), bf16 and f16, rows 1, 3, 17 and
/// 128 of widths 576 (SmolLM2) and 4096 (Llama-8B), the kernels' 4-element path, and 1001,
/// their one-element path; embed then gather of a 16-bit table.
#[test]
fn residual16_kernels_match_the_cpu_oracle() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = super::shape();
    let mut rng = ChaCha8Rng::seed_from_u64(2916);
    let eps = 1e-5;
    for (dt, ty) in X16 {
        let mut g = CudaBackend::new(&m.config, &cfg(dt)).expect("CUDA backend");
        g.set_act16(true).unwrap();
        assert!(g.residual16(), "{dt:?}: the switch leaves the residual f32");
        let mut cpu = CpuBackend::new(&m.config);
        cpu.set_act16(Some(ty));
        // 1001: not a multiple of 4, the kernels' one-element path.
        for d in [576, 4096, 1001] {
            for rows in [1, 3, 17, 128] {
                let n = rows * d;
                let label = format!("{dt:?} rows {rows} d {d}");
                let h: Vec<u16> = rand_vec(&mut rng, n, 4.0)
                    .iter()
                    .map(|&v| bits(v, dt))
                    .collect();
                let x = rand_vec(&mut rng, n, 2.0);
                // The norm weights as the upload stores them (the weight dtype).
                let w = rounded(&rand_vec(&mut rng, d, 1.5), dt);
                let h0: Vec<f32> = h.iter().map(|&b| value(b, dt)).collect();
                // Add + norm: the residual rounded once, the norm of the rounded sum.
                let (h_after, out, o16) = g
                    .residual_norm16_host(&h, Some(&x), &w, (rows, d), eps)
                    .unwrap();
                let (mut hc, mut oc) = (h0.clone(), vec![0.0; n]);
                cpu.add_rms_norm(&mut hc, &x, &w, eps, rows, d, &mut oc);
                let want_h: Vec<u16> = hc.iter().map(|&v| bits(v, dt)).collect();
                assert_eq!(h_after, want_h, "{label}: the stored residual");
                let e = rel_err(&out, &oc);
                assert!(e <= 1e-5, "{label}: add_rms_norm_h16 out rel err {e:e}");
                let off = o16
                    .iter()
                    .zip(&oc)
                    .filter(|(&b, &v)| b.abs_diff(bits(v, dt)) > 1)
                    .count();
                assert_eq!(off, 0, "{label}: 16-bit copies more than one ulp off");
                // Layer 0's norm reads the residual without adding.
                let (h_same, out0, _) = g
                    .residual_norm16_host(&h, None, &w, (rows, d), eps)
                    .unwrap();
                assert_eq!(h_same, h, "{label}: the norm wrote the residual");
                let mut oc0 = vec![0.0; n];
                cpu.residual_norm(&h0, &w, eps, rows, &mut oc0);
                let e = rel_err(&out0, &oc0);
                assert!(e <= 1e-5, "{label}: rms_norm_h16 rel err {e:e}");
                println!("{label}: residual16 kernels match the CPU oracle");
            }
        }
        // Embed then the final gather: the 16-bit table's rows, exactly, as the CPU's.
        let (vocab, d) = (m.config.vocab_size, m.config.hidden_size);
        let table = rounded(&rand_vec(&mut rng, vocab * d, 1.0), dt);
        let t = g.upload_linear(table.clone(), vocab, d, None).unwrap();
        let tc = cpu.upload_linear(table, vocab, d, None).unwrap();
        let ids: Vec<u32> = (0..17).map(|i| (i * 31 % vocab) as u32).collect();
        let got = g.embed_gather_host(&t, &ids, 3..11).unwrap();
        let (mut hc, mut want) = (vec![0.0; ids.len() * d], vec![0.0; 8 * d]);
        cpu.embed(&tc, &ids, &mut hc);
        let pick: Vec<usize> = (3..11).collect();
        cpu.gather_residual(&hc, d, &pick, &mut want);
        assert_eq!(got, want, "{dt:?}: embed + gather_residual");
    }
}

/// The test preset as a Qwen2 (q/k/v biases) with weights from `seed`.
fn qwen2(seed: u64) -> TestModel {
    let arch = ArchOptions {
        arch: GenArch::Qwen2,
        ..Default::default()
    };
    TestModel::with_arch(&test_preset(), seed, arch)
}

/// Whole engines, the switch off against on (eager, and with CUDA graphs: every decode batch
/// captured then replayed), on Llama and Qwen2 test models, base rows and rows on a q/v
/// adapter: batches of 1, 3 and 8, 6 decode steps, each compared as `act16.rs`' engines
/// (`compare_logged`): the prefill's token too may part at a near tie (seen on an H200: Qwen2,
/// bf16, one sequence's prefill token 226 vs 312 with the switch on), logits within 2e-2.
#[test]
fn engines_with_the_16_bit_residual_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let models = [("llama", TestModel::llama(29)), ("qwen2", qwen2(29))];
    for (name, tm) in &models {
        let adapters = [tm.adapter(8, &["q", "v"], 2929)];
        let vocab = tm.model.config.vocab_size;
        for (dt, _) in X16 {
            let mut runs = Vec::new();
            for (on, graphs) in [(false, false), (true, false), (true, true)] {
                let mut e = engine_with(&tm.model, dt, &adapters, graphs, |g| {
                    g.set_gemv(false).unwrap();
                    g.set_act16(on).unwrap();
                    assert_eq!(g.residual16(), on);
                });
                let (mut first, mut all) = (0, Vec::new());
                for b in [1usize, 3, 8] {
                    let who: Vec<Option<u32>> = (0..b).map(|i| (i % 2 == 1).then_some(0)).collect();
                    let p = prompts(b, vocab, 290 + b as u64);
                    all.extend(decode_logged(&mut e, first, &who, &p, 6));
                    first += b as u64;
                }
                runs.push(all);
            }
            compare_logged(&format!("{dt:?} residual16 {name}"), &runs, 2e-2);
        }
    }
}

/// A steady decode step with the switch on allocates nothing and launches as many kernels and
/// products as the switch off (each residual kernel stands in for one f32 kernel; two rows on a
/// q/v adapter keep the attention half f32); a steady graph replay with it on is one graph launch, nothing from the host.
#[test]
fn steady_steps_with_the_16_bit_residual_allocate_nothing() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    for (dt, _) in X16 {
        let mut per_switch = Vec::new();
        for on in [false, true] {
            let counts = decode_counts_with(&tm, dt, 3, |b| {
                b.set_gemv(false).unwrap();
                b.set_act16(on).unwrap();
            });
            for c in &counts {
                assert_eq!((c.allocs, c.alloc_bytes), (0, 0), "{dt:?} {on}: allocated");
                assert_eq!(c, &counts[0], "{dt:?} {on}: steps differ");
            }
            per_switch.push(counts[0]);
        }
        // Two rows on a q/v adapter (`decode_counts_with`): the attention half keeps f32.
        assert_eq!(
            (per_switch[1].launches, per_switch[1].gemms),
            (per_switch[0].launches, per_switch[0].gemms),
            "{dt:?}: the 16-bit residual launched another number of kernels or products"
        );
        let counts = decode_counts_on(&tm, dt, 4, (None, true), |g| {
            g.set_gemv(false).unwrap();
            g.set_act16(true).unwrap();
        });
        for c in &counts {
            assert_eq!(
                (c.allocs, c.alloc_bytes),
                (0, 0),
                "{dt:?}: a replay allocated"
            );
            assert_eq!((c.graph_launches, c.gemms), (1, 0), "{dt:?}: {c:?}");
        }
    }
}
