//! The small-batch GEMV (`gemv.cu`, a default; off: `THAW_CUDA_GEMV=0`) against the CPU
//! oracle and the cast + cuBLAS path it replaces (cuBLASLt, also a default, where the switch is
//! off), op by op on Llama-7B's decode shapes and odd ones, and whole engines with it on
//! against off (the 16-bit activations off in both). Part of `cuda_parity` (its helpers, its
//! GPU skip rules).
//!
//! Tolerances (normwise relative, `rel_err`; DESIGN §9):
//! - GEMV against the CPU oracle over the same 16-bit weights (rounded on the host first, so
//!   both multiply identical operands: the f32 activations and the exact weights): 1e-5 — f32
//!   products summed in another order (per lane in d_in order, then across lanes; ~√d_in ulp);
//! - GEMV against cast + cuBLAS: the suite's 16-bit 1e-2 — cuBLAS rounds the activations to
//!   the weight dtype first (bf16: 2^-9 relative per activation), the GEMV does not; that the
//!   GEMV ran is checked by it being closer to the oracle than cuBLAS for bf16;
//! - a shape the GEMV does not take (d_in % 8 != 0) runs cuBLAS with the switch on: bit for bit
//!   the switch off;
//! - engines: logits within the suite's 1e-2 and greedy tokens identical, except at a near tie
//!   (`same_greedy_tokens`): the GEMV multiplies the f32 activations where cuBLAS multiplies
//!   their 16-bit rounding, so two logits within that rounding of each other may swap places;
//!   such a step must be a near tie of the off run (top two within [`NEAR_TIE`] of the largest
//!   |logit|), and the sequence is compared no further (its contexts differ from there).
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::{CudaBackend, DType};
use thaw_runtime::backend::kernel_select::{gemv_pays, gemv_serves};
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::HostModel;
use thaw_tests::graphs::{decode_batch, prompts, Decoded};
use thaw_tests::{rel_err, TestModel};

use super::graphs::engine_with;
use super::opt_in::bitwise;
use super::{cfg, check, rand_vec, shape};

/// (d_in, d_out): q/k/v/o, gate/up and down of Llama-7B, a small model's pair, a d_in whose
/// 8-groups (125) leave a partial round of lanes, and one not a multiple of 8 (cuBLAS runs).
const SHAPES: [(usize, usize); 7] = [
    (4096, 4096),
    (4096, 11008),
    (11008, 4096),
    (576, 1536),
    (1536, 576),
    (1000, 77),
    (1001, 40),
];

const X16: [DType; 2] = [DType::Bf16, DType::F16];

/// A decode step whose top two logits are closer than this (relative to the step's largest
/// |logit|) may pick either token when the activations' rounding changes (bf16: 2^-9 relative
/// per activation, ~1e-3 on a logit).
pub(super) const NEAR_TIE: f32 = 1e-2;

/// Whether the step's two largest logits are within [`NEAR_TIE`] of each other.
pub(super) fn near_tie(logits: &[f32]) -> bool {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    let scale = logits.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    (a - b) <= NEAR_TIE * scale
}

/// `on`'s greedy tokens and logits against `off`'s for one sequence of `vocab`-wide steps.
/// f32 weights (the GEMV does not run): identical tokens, logits within `tol`. 16-bit weights:
/// the prefill's token identical; each decode step's logits within `tol` and its token
/// identical, unless `off`'s logits at that step are a near tie: then the sequences may part
/// there and are compared no further. Returns whether they parted at a near tie.
pub(super) fn same_greedy_tokens(
    what: &str,
    dt: DType,
    tol: f64,
    off: &Decoded,
    on: &Decoded,
    vocab: usize,
) -> bool {
    assert_eq!(off.tokens.len(), on.tokens.len(), "{what}: step counts");
    assert_eq!(
        off.tokens.first(),
        on.tokens.first(),
        "{dt:?} {what}: the prefill's greedy token differs"
    );
    for s in 1..off.tokens.len() {
        let step = (s - 1) * vocab..s * vocab;
        let (lo, ln) = (&off.logits[step.clone()], &on.logits[step]);
        check(&format!("{what} step {s}"), dt, tol, ln, lo);
        if off.tokens[s] != on.tokens[s] {
            assert!(
                dt != DType::F32 && near_tie(lo),
                "{dt:?} {what}: greedy token of step {s} differs ({} vs {}) and the step is not \
                 a near tie",
                off.tokens[s],
                on.tokens[s]
            );
            return true;
        }
    }
    false
}

/// `v` rounded to `dt` and back (round to nearest even, as the upload encodes).
pub(super) fn rounded(v: &[f32], dt: DType) -> Vec<f32> {
    match dt {
        DType::Bf16 => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        DType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        DType::F32 => v.to_vec(),
    }
}

#[test]
fn gemv_matches_the_cpu_oracle_and_cublas_for_1_to_8_rows() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    let max_rows = thaw_kernels::cuda::registry::shape::GEMV_MAX_ROWS;
    let mut rng = ChaCha8Rng::seed_from_u64(2901);
    for dt in X16 {
        let mut cpu = CpuBackend::new(c);
        let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
        for (d_in, d_out) in SHAPES {
            // Weights scaled so outputs stay O(1) (f16's range) whatever d_in.
            let scale = 2.0 / (d_in as f32).sqrt();
            let w = rounded(&rand_vec(&mut rng, d_out * d_in, scale), dt);
            let x = rand_vec(&mut rng, max_rows * d_in, 1.0);
            let lc = cpu.upload_linear(w.clone(), d_out, d_in, None).unwrap();
            let lg = g.upload_linear(w, d_out, d_in, None).unwrap();
            let mut want = vec![0.0; max_rows * d_out];
            cpu.linear(&x, &lc, max_rows, &mut want);
            let xg = g.upload_f32(&x).unwrap();
            let served = gemv_serves(true, dt, 1, d_in, d_out, 0, 0);
            for rows in 1..=max_rows {
                let want = &want[..rows * d_out];
                let mut runs = Vec::new();
                for on in [false, true] {
                    g.set_gemv(on).unwrap();
                    // The kernel at every row count it takes, where it pays or not.
                    g.set_gemv_every_row(true);
                    let mut y = g.alloc(rows * d_out).unwrap();
                    g.linear(&xg, &lg, rows, &mut y);
                    runs.push(g.download_f32(&y, rows * d_out).unwrap());
                }
                let (cublas, gemv) = (&runs[0], &runs[1]);
                let what = format!("gemv {d_in}->{d_out} rows {rows}");
                check(&format!("{what} vs cublas"), dt, 1e-2, gemv, cublas);
                if served {
                    check(&format!("{what} vs cpu"), dt, 1e-5, gemv, want);
                    if dt == DType::Bf16 {
                        let (eg, ec) = (rel_err(gemv, want), rel_err(cublas, want));
                        assert!(
                            eg < ec,
                            "{what}: the GEMV ({eg:e}) is not closer to the oracle than \
                             cuBLAS over bf16-rounded activations ({ec:e}): did it run?"
                        );
                    }
                } else {
                    assert!(
                        bitwise(gemv, cublas),
                        "{dt:?} {what}: a shape the GEMV does not take changed with it on"
                    );
                }
            }
        }
        g.check().unwrap();
    }
}

/// Rows above the GEMV's limit, rows where it does not pay (`gemv_pays`: 3–8 rows of a
/// product larger than 4096 × 4096, 5–8 of any), and f32 weights run cuBLAS bit for bit with
/// the switch on.
#[test]
fn gemv_leaves_what_it_does_not_take_to_cublas() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let c = &m.config;
    let mut rng = ChaCha8Rng::seed_from_u64(2902);
    let cases = [
        (DType::Bf16, 9, (512, 256)),
        (DType::F16, 37, (512, 256)),
        (DType::F32, 1, (512, 256)),
        (DType::Bf16, 3, (4096, 11008)),
        (DType::F16, 4, (11008, 4096)),
        (DType::Bf16, 5, (4096, 4096)),
        (DType::Bf16, 8, (576, 1536)),
    ];
    for (dt, rows, (d_in, d_out)) in cases {
        assert!(!gemv_pays(rows, d_in, d_out) || rows > 8 || dt == DType::F32);
        let mut g = CudaBackend::new(c, &cfg(dt)).expect("CUDA backend");
        let w = rand_vec(&mut rng, d_out * d_in, 0.1);
        let x = rand_vec(&mut rng, rows * d_in, 1.0);
        let lg = g.upload_linear(w, d_out, d_in, None).unwrap();
        let xg = g.upload_f32(&x).unwrap();
        let mut runs = Vec::new();
        for on in [false, true] {
            g.set_gemv(on).unwrap();
            assert_eq!(g.gemv(), on);
            let mut y = g.alloc(rows * d_out).unwrap();
            g.linear(&xg, &lg, rows, &mut y);
            runs.push(g.download_f32(&y, rows * d_out).unwrap());
        }
        assert!(
            bitwise(&runs[0], &runs[1]),
            "{dt:?} rows {rows}: the switch changed a product the GEMV does not take"
        );
        g.check().unwrap();
    }
}

/// Engines over `model` in `dt` with `switch(backend, on)`: off (eager), on (eager), on (CUDA
/// graphs), each decoding `batches` (sequence `i` of a batch of `b` on adapter `who(b)[i]`,
/// prompts from `seed`) for `steps` steps, twice: graphs are captured on the first pass and
/// replayed on the second. The three runs' outputs, in that order.
#[allow(clippy::too_many_arguments)]
pub(super) fn off_on_runs(
    model: &HostModel,
    dt: DType,
    adapters: &[Arc<LoraAdapter>],
    batches: &[usize],
    who: impl Fn(usize) -> Vec<Option<u32>>,
    steps: usize,
    seed: u64,
    switch: impl Fn(&mut CudaBackend, bool),
) -> Vec<Vec<Vec<Decoded>>> {
    let vocab = model.config.vocab_size;
    let mut runs = Vec::new();
    for (on, graphs) in [(false, false), (true, false), (true, true)] {
        let mut e = engine_with(model, dt, adapters, graphs, |b| switch(b, on));
        let mut first = 0;
        let mut per_batch = Vec::new();
        for _ in 0..2 {
            for &b in batches {
                let p = prompts(b, vocab, seed + b as u64);
                per_batch.push(decode_batch(&mut e, first, &who(b), &p, steps));
                first += b as u64;
            }
        }
        runs.push(per_batch);
    }
    runs
}

/// [`off_on_runs`]' two "on" runs against "off", sequence by sequence with
/// [`same_greedy_tokens`]; prints one line each.
pub(super) fn check_off_on(
    what: &str,
    dt: DType,
    tol: f64,
    runs: &[Vec<Vec<Decoded>>],
    vocab: usize,
) {
    for (m, name) in [(1, "on, eager"), (2, "on, graphs")] {
        let (mut parted, mut seqs, mut worst) = (0, 0, 0.0f64);
        for (k, (off, on)) in runs[0].iter().zip(&runs[m]).enumerate() {
            for (i, (a, b)) in off.iter().zip(on).enumerate() {
                worst = worst.max(rel_err(&b.logits, &a.logits));
                let label = format!("{what} {name} b{k} s{i}");
                parted += usize::from(same_greedy_tokens(&label, dt, tol, a, b, vocab));
                seqs += 1;
            }
        }
        println!(
            "{dt:?}: {what} {name}: {seqs} sequences, {parted} parted at a near tie, the rest \
             the same tokens; worst logits rel err {worst:.2e} (parted ones included)"
        );
    }
}

/// Whole engines with the GEMV off and on (eager, and on with CUDA graphs): decode batches of
/// 1, 3 and 8 run every product (q/k/v/o, gate/up/down, the LM head) through it; 20 through
/// cuBLAS. Identical greedy tokens (but at near ties), with and without adapters.
#[test]
fn engines_with_the_gemv_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let adapters = [tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 84)];
    let vocab = tm.model.config.vocab_size;
    let who = |b: usize| -> Vec<Option<u32>> { (0..b).map(|i| [None, Some(0)][i % 2]).collect() };
    for dt in X16 {
        let runs = off_on_runs(
            &tm.model,
            dt,
            &adapters,
            &[1, 3, 8, 20],
            who,
            6,
            300,
            // The 16-bit activations off in both: their plan keeps f32 where the GEMV takes a
            // product (`act16_plan`), so with them on (a default) this switch would also move
            // their rounding, which is not the GEMV's.
            |b, on| {
                b.set_act16(false).unwrap();
                b.set_gemv(on).unwrap();
            },
        );
        check_off_on("gemv", dt, 1e-2, &runs, vocab);
    }
}
