//! Greedy sampling on the device (issue 29, `argmax.cu`; a default, off: `THAW_CUDA_DEVICE_ARGMAX=0`)
//! against the host's argmax (`sampling::argmax`, the greedy sampler's choice). Part of
//! `cuda_parity` (its helpers, its GPU skip rules).
//!
//! Tolerance: none. An argmax does no arithmetic, so the device's ids must equal the host's
//! exactly — the lowest index among equal values, NaNs skipped unless first — on raw rows
//! (ties, ±inf, NaN, subnormals), through the LM head (the host scanning the same device
//! logits), and in whole engines: greedy tokens identical with the kernel on and off, eager and
//! CUDA-graph steps alike.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::backend::cuda::{CudaBackend, DType};
use thaw_runtime::backend::greedy::argmax_rows;
use thaw_runtime::backend::Backend;
use thaw_runtime::sampling::SamplingParams;
use thaw_tests::graphs::prompts;
use thaw_tests::greedy::{generate, token_ids};
use thaw_tests::TestModel;

use super::graphs::engine_with;
use super::{cfg, rand_vec, shape, CONFIGS};

/// Rows of logits with what the host's rule must get right: coarse values (ties), ±inf, NaN
/// (a NaN first entry in some rows), subnormals and ±0, a row of -inf, a row with its maximum
/// in the last entry.
fn hard_rows(rng: &mut ChaCha8Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..rows * vocab)
        .map(|_| match rng.random_range(0..1000) {
            0..=2 => f32::NAN,
            3..=5 => f32::NEG_INFINITY,
            6 => f32::INFINITY,
            7 => f32::MIN_POSITIVE / 8.0,
            8 => -0.0,
            _ => rng.random_range(-64i32..64) as f32 / 8.0,
        })
        .collect();
    for r in 0..rows {
        let row = &mut l[r * vocab..(r + 1) * vocab];
        match r % 5 {
            0 => row[0] = f32::NAN,
            1 => row.fill(f32::NEG_INFINITY),
            2 => row[vocab - 1] = 1e30,
            3 => {
                // Only subnormals and zeros: the largest subnormal, first occurrence.
                row.fill(0.0);
                row[vocab / 3] = f32::MIN_POSITIVE / 2.0;
                row[vocab / 2] = f32::MIN_POSITIVE / 2.0;
            }
            _ => {}
        }
    }
    l
}

#[test]
fn device_argmax_equals_the_host_argmax_on_raw_rows() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let mut g = CudaBackend::new(&m.config, &cfg(DType::F32)).expect("CUDA backend");
    // Off (whatever THAW_CUDA_DEVICE_ARGMAX says): `argmax_of` loads the kernel for the call.
    g.set_device_argmax(false).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(2931);
    for vocab in [32_000, 49_152, 1, 31, 513] {
        for rows in [1, 2, 5, 17, 32, 64] {
            let l = hard_rows(&mut rng, rows, vocab);
            let dev = g.upload_f32(&l).unwrap();
            let got = g.argmax_of(&dev, rows, vocab).unwrap();
            let mut want = Vec::new();
            argmax_rows(&l, rows, &mut want);
            assert_eq!(got, want, "vocab {vocab}, batch {rows}");
        }
        println!("argmax vocab {vocab}: batch 1..64 equal to the host");
    }
    assert!(
        !g.device_argmax(),
        "argmax_of leaves the switch as it found it"
    );
    g.check().unwrap();
}

#[test]
fn device_argmax_through_the_lm_head_equals_the_host_on_its_logits() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let m = shape();
    let d = m.config.hidden_size;
    let mut rng = ChaCha8Rng::seed_from_u64(2932);
    for (dt, _) in CONFIGS {
        let mut g = CudaBackend::new(&m.config, &cfg(dt)).expect("CUDA backend");
        g.set_device_argmax(true).unwrap();
        for vocab in [32_000, 49_152] {
            // Repeated LM-head rows give exactly equal logits: ties the lowest id must win.
            let mut w = rand_vec(&mut rng, vocab * d, 0.5);
            for k in 0..64 {
                let (from, to) = (k * 97 % vocab, (k * 7919 + 13) % vocab);
                let src = w[from * d..(from + 1) * d].to_vec();
                w[to * d..(to + 1) * d].copy_from_slice(&src);
            }
            let head = g.upload_linear(w, vocab, d, None).unwrap();
            for rows in [1, 3, 32, 64] {
                let x = g.upload_f32(&rand_vec(&mut rng, rows * d, 2.0)).unwrap();
                let (mut scratch, mut ids) = (Vec::new(), Vec::new());
                g.greedy_ids(&x, &head, rows, &mut scratch, &mut ids);
                let mut logits = Vec::new();
                g.logits(&x, &head, rows, &mut logits);
                let mut want = Vec::new();
                argmax_rows(&logits, rows, &mut want);
                assert_eq!(ids, want, "{dt:?} vocab {vocab}, batch {rows}");
            }
        }
        g.check().unwrap();
    }
}

#[test]
fn greedy_tokens_are_identical_with_device_argmax_on_and_off() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(7);
    let adapters = [tm.adapter(8, &["q", "v"], 70)];
    let who: Vec<Option<u32>> = (0..5).map(|i| (i % 2 == 1).then_some(0)).collect();
    let p = prompts(who.len(), tm.model.config.vocab_size, 29);
    let greedy = vec![SamplingParams::greedy(); who.len()];
    let new_tokens = 8;
    for (dt, _) in CONFIGS {
        let mut runs = Vec::new();
        for graphs in [false, true] {
            for on in [false, true] {
                // The 16-bit activations off (a default with bf16 weights): their plan differs
                // between eager and graph steps by design (`graphs.rs`), and these tokens are
                // compared across the two exactly.
                let setup = |b: &mut CudaBackend| {
                    b.set_device_argmax(on).unwrap();
                    b.set_act16(false).unwrap();
                };
                let mut e = engine_with(&tm.model, dt, &adapters, graphs, setup);
                assert_eq!(e.backend().device_argmax(), on);
                let t = generate(&mut e, 0, &who, &p, &greedy, new_tokens);
                assert_eq!(e.greedy_id_steps(), new_tokens as u64);
                if graphs {
                    let s = e.graph_stats().expect("graphs on");
                    assert!(s.replays > 0, "{dt:?}: decode steps replayed graphs: {s:?}");
                }
                runs.push((graphs, on, token_ids(&t)));
            }
        }
        let (_, _, base) = &runs[0];
        for (graphs, on, t) in &runs[1..] {
            assert_eq!(
                t, base,
                "{dt:?} graphs {graphs}, device argmax {on}: the greedy tokens changed"
            );
        }
        println!("{dt:?}: greedy tokens identical, device argmax on/off, eager and graphs");
    }
}
