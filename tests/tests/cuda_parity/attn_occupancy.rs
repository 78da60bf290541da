//! The occupancy-planned decode attention with keys in flight (`attention_split_ilp.cu`,
//! issue 29; a default, off: `THAW_CUDA_ATTN_OCCUPANCY=0`, [`CudaBackend::set_attn_occupancy`]) against
//! the CPU oracle and against `attention.cu`'s decode, and whole engines (eager and CUDA graphs)
//! with it on against it off. Part of `cuda_parity` (its helpers, its GPU skip rules).
//!
//! Tolerances (normwise relative, `rel_err`):
//! - against the CPU oracle: the suite's (f32 1e-4, bf16 1e-2, f16 1e-2);
//! - against `attention.cu` over the same cache: one split (a context under 2 · floor) 1e-6 —
//!   the same keys in the same warps, the same per-key f32 operations, so bit for bit unless
//!   the compiler contracts a multiply-add into an FMA differently in the two kernels (the
//!   test prints which); more splits 1e-5,
//!   every cache dtype alike (the same cached values; only the f32 merge of the splits'
//!   partial softmaxes is summed in another order);
//! - engines: greedy tokens identical (but at a near tie with a 16-bit cache), logits within
//!   the suite's tolerance.
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_kernels::cpu::KvLayout;
use thaw_kernels::cuda::decode_plan::OCC_MIN_CHUNK;
use thaw_runtime::backend::cuda::{AttnImpl, CudaBackend, DType};
use thaw_runtime::backend::Backend;
use thaw_tests::TestModel;

use super::gemv::{check_off_on, off_on_runs};
use super::opt_in::bitwise;
use super::{attention_vs_cpu, cfg, check, classic_kernels, prefix_step, rand_vec, shape, step_of};

const ALL: [(DType, f64); 3] = [(DType::F32, 1e-4), (DType::Bf16, 1e-2), (DType::F16, 1e-2)];
const CONTEXTS: [usize; 7] = [1, 7, 33, 130, 512, 2048, 8191];
const BATCHES: [usize; 3] = [1, 8, 32];

/// `batch` decode rows, each with `ctx` positions of context (its new one included).
fn decodes(
    batch: usize,
    ctx: usize,
    block_size: usize,
) -> (thaw_runtime::backend::StepLayout, usize) {
    step_of(&vec![(ctx - 1, 1); batch], block_size)
}

/// Decode rows of every context at batch 1, 8 and 32 (GQA 8/2 heads of 64, with and without a
/// sliding window, every cache dtype) against the CPU oracle, with the default floor (32) and
/// with a floor of 1 (every context of 2 or more positions split, up to 64 ways). The CPU
/// oracle prefills each context first, so the longest ones run at batch 1 only.
#[test]
fn occupancy_decode_matches_cpu() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let mut c = shape().config;
    for window in [None, Some(100)] {
        c.sliding_window = window;
        for batch in BATCHES {
            for ctx in CONTEXTS.into_iter().filter(|&n| n * batch <= 4200) {
                let (step, nb) = decodes(batch, ctx, 16);
                for dt in ALL {
                    // The window with the default floor only (it keeps the suite's time down).
                    let floors: &[usize] = if window.is_some() {
                        &[OCC_MIN_CHUNK]
                    } else {
                        &[OCC_MIN_CHUNK, 1]
                    };
                    for &floor in floors {
                        let what = format!("occ b{batch} ctx{ctx} w{window:?} f{floor}");
                        attention_vs_cpu(&c, dt, (&step, nb), 16, &what, |g| {
                            classic_kernels(g);
                            g.set_attn_occupancy(Some(floor)).unwrap();
                            assert_eq!(g.attn_occupancy(), Some(floor));
                        });
                    }
                }
            }
        }
    }
}

/// Every context at batch 1, 8 and 32 (but more than 70k cached positions in all: 8191 at batch
/// 32) on one GPU backend: the prefixes prefilled once, then the same decode step through
/// `attention.cu` and through the occupancy kernels (floors 32 and 4) over the same cache.
#[test]
fn occupancy_decode_matches_the_classic_kernel_up_to_8k_contexts() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let mut c = shape().config;
    let mut rng = ChaCha8Rng::seed_from_u64(2929);
    let (qw, kw) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    // The window with a bf16 cache only (it keeps the suite's time down).
    for (window, dt) in ALL
        .map(|(dt, _)| (None, dt))
        .into_iter()
        .chain([(Some(1000), DType::Bf16)])
    {
        c.sliding_window = window;
        for batch in BATCHES {
            for ctx in CONTEXTS.into_iter().filter(|&n| n * batch <= 70_000) {
                let (step, nb) = decodes(batch, ctx, 16);
                let pre = prefix_step(&step);
                let mut g = CudaBackend::new(&c, &cfg(dt)).unwrap();
                classic_kernels(&mut g);
                let layout = KvLayout {
                    block_size: 16,
                    num_kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                };
                let mut kv = g.alloc_kv_layer(layout, nb).unwrap();
                let mut outs = Vec::new();
                // The prefill, then the decode with each kernel (rewriting the same K/V).
                let q = rand_vec(&mut rng, batch * qw, 1.0);
                let k = rand_vec(&mut rng, batch * kw, 1.0);
                let v = rand_vec(&mut rng, batch * kw, 1.0);
                for (st, floor) in [
                    (&pre, None),
                    (&step, None),
                    (&step, Some(32)),
                    (&step, Some(4)),
                ] {
                    let n = st.rows();
                    if n == 0 {
                        continue;
                    }
                    g.set_attn_occupancy(floor).unwrap();
                    let (qh, kh, vh) = if std::ptr::eq(st, &pre) {
                        (
                            rand_vec(&mut rng, n * qw, 1.0),
                            rand_vec(&mut rng, n * kw, 1.0),
                            rand_vec(&mut rng, n * kw, 1.0),
                        )
                    } else {
                        (q.clone(), k.clone(), v.clone())
                    };
                    let (qg, kg, vg) = (
                        g.upload_f32(&qh).unwrap(),
                        g.upload_f32(&kh).unwrap(),
                        g.upload_f32(&vh).unwrap(),
                    );
                    let mut og = g.alloc(n * qw).unwrap();
                    // embed marks a new step for the backend's per-step metadata.
                    let table = g.upload_linear(vec![0.0; 4], 2, 2, None).unwrap();
                    let mut scratch = g.alloc(n * 2).unwrap();
                    g.embed(&table, &vec![0; n], &mut scratch);
                    g.attention(&qg, &kg, &vg, &mut kv, st, &mut og);
                    if std::ptr::eq(st, &step) {
                        outs.push((floor, g.download_f32(&og, n * qw).unwrap()));
                    }
                }
                g.check().unwrap();
                let classic = &outs[0].1;
                for (floor, got) in &outs[1..] {
                    let f = floor.expect("occupancy runs");
                    let what = format!("occ/classic b{batch} ctx{ctx} w{window:?} f{f}");
                    let attended = window.map_or(ctx, |w| ctx.min(w));
                    if attended < 2 * f {
                        let same = bitwise(got, classic);
                        println!("{what} {dt:?}: one split, bit for bit: {same}");
                        check(&what, dt, 1e-6, got, classic);
                    } else {
                        check(&what, dt, 1e-5, got, classic);
                    }
                }
            }
        }
    }
}

/// Whole engines with the occupancy decode off and on (floor 1: every decode splits), eager
/// and on with CUDA graphs (a split count fixed per bucket: each row uses what its context
/// allows, the rest write neutral partials), decode batches of 1, 3, 8 and
/// 20 with and without an adapter: identical greedy tokens (but at near ties of a 16-bit cache).
#[test]
fn engines_with_the_occupancy_decode_give_the_same_tokens() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let adapters = [tm.adapter(16, &["q", "v"], 85)];
    let vocab = tm.model.config.vocab_size;
    let who = |b: usize| -> Vec<Option<u32>> { (0..b).map(|i| [None, Some(0)][i % 2]).collect() };
    for (dt, tol) in ALL {
        let runs = off_on_runs(
            &tm.model,
            dt,
            &adapters,
            &[1, 3, 8, 20],
            who,
            6,
            290,
            |b, on| {
                b.set_attn_occupancy(on.then_some(1)).unwrap();
                if !on {
                    b.set_attn_impl(AttnImpl::Classic).unwrap();
                }
            },
        );
        check_off_on("occupancy decode", dt, tol, &runs, vocab);
    }
}
