//! One CPU-assisted prefill layer on the GPU side: the base projections of a Llama-3-8B layer
//! with every row cold, (a) bare, (b) with the fused export + stream-waited merges, (c) with a
//! synchronous copy-then-signal export and host merges (the trait's `export_rows` /
//! `merge_rows`, what the engine's assist path runs today). The workers are pre-completed, so
//! only what the GPU side adds shows (CaraServe §5: the fused path saves ~16% per iteration).
use std::sync::atomic::Ordering;
use std::time::Instant;

use thaw_ipc::{Exchange, ExchangeConfig, StepSeq, WorkerId, WORKER_RESULT};
use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig, CudaLinear};
use thaw_runtime::backend::Backend;

use super::{fill, model_config, time_us, Res};

/// (module, d_out, d_in, which activation is its input: 0 normed, 1 attn out, 2 normed, 3 act).
const MODULES: [(LoraModule, usize, usize, usize); 7] = [
    (LoraModule::Q, 4096, 4096, 0),
    (LoraModule::K, 1024, 4096, 0),
    (LoraModule::V, 1024, 4096, 0),
    (LoraModule::O, 4096, 4096, 1),
    (LoraModule::Gate, 14336, 4096, 2),
    (LoraModule::Up, 14336, 4096, 2),
    (LoraModule::Down, 4096, 14336, 3),
];

pub fn prefill_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    let max_rows = 512u32;
    let ex = Exchange::create(ExchangeConfig {
        max_workers: 2,
        max_rows,
        ..Default::default()
    })?;
    let mapped = g.map_exchange(&ex)?;
    let l = *ex.layout();
    for w in 0..2usize {
        ex.segment()
            .atomic_u32(l.workers + w * 64 + WORKER_RESULT)
            .store(1 << 30, Ordering::SeqCst);
    }
    let weights: Vec<CudaLinear> = MODULES
        .iter()
        .enumerate()
        .map(|(i, &(_, o, n, _))| g.upload_linear(fill(o * n, 50 + i as u64), o, n, None))
        .collect::<Result<_, _>>()?;
    let r = max_rows as usize;
    let inputs: Vec<_> = [4096, 4096, 4096, 14336]
        .iter()
        .enumerate()
        .map(|(i, &w)| g.upload_f32(&fill(r * w, 60 + i as u64)))
        .collect::<Result<_, _>>()?;
    let mut outs: Vec<_> = MODULES
        .iter()
        .map(|&(_, o, _, _)| g.alloc(r * o))
        .collect::<Result<_, _>>()?;
    println!("\n## One prefill layer, Llama-3-8B shapes, bf16 weights, every row cold (workers pre-completed; median of 20)");
    println!("| rows | base GEMMs µs | + fused export & waited merges µs | overhead | + sync copy-then-signal µs (host wall) | overhead |\n|---|---|---|---|---|---|");
    let mut seq = 1u32;
    for &rows in if smoke {
        &[128usize][..]
    } else {
        &[16, 128, 512][..]
    } {
        let sel: Vec<usize> = (0..rows).collect();
        let base = time_us(&mut g, 20, |g| {
            for (i, &(_, _, _, inp)) in MODULES.iter().enumerate() {
                g.linear(&inputs[inp], &weights[i], rows, &mut outs[i]);
            }
        })?;
        let fused = time_us(&mut g, 20, |g| {
            seq += 1;
            let mut exported = [false; 4];
            for (i, &(m, o, n, inp)) in MODULES.iter().enumerate() {
                if !exported[inp] {
                    exported[inp] = true;
                    let _ = g.export_rows_fused(
                        &mapped,
                        &inputs[inp],
                        n,
                        &sel,
                        inp as u32,
                        StepSeq(seq),
                    );
                }
                g.linear(&inputs[inp], &weights[i], rows, &mut outs[i]);
                let _ = g.merge_deltas_waited(
                    &mapped,
                    &mut outs[i],
                    o,
                    m,
                    &sel,
                    StepSeq(seq),
                    &[WorkerId(0), WorkerId(1)],
                );
            }
        })?;
        let mut host_in = vec![0.0f32; r * 14336];
        let host_delta = fill(r * 14336, 70);
        let mut run_sync = |g: &mut CudaBackend, seq: &mut u32| {
            *seq += 1;
            let mut exported = [false; 4];
            for (i, &(_, o, n, inp)) in MODULES.iter().enumerate() {
                if !exported[inp] {
                    exported[inp] = true;
                    g.export_rows(
                        &inputs[inp],
                        n,
                        std::slice::from_ref(&(0..rows)),
                        &mut host_in,
                        n,
                    );
                    ex.seq_word().store(*seq, Ordering::SeqCst);
                }
                g.linear(&inputs[inp], &weights[i], rows, &mut outs[i]);
                g.merge_rows(
                    &mut outs[i],
                    o,
                    std::slice::from_ref(&(0..rows)),
                    &host_delta,
                    o,
                );
            }
        };
        run_sync(&mut g, &mut seq);
        g.synchronize()?;
        let mut t = Vec::new();
        for _ in 0..20 {
            let t0 = Instant::now();
            run_sync(&mut g, &mut seq);
            g.synchronize()?;
            t.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        t.sort_by(f64::total_cmp);
        let sync = t[t.len() / 2];
        println!(
            "| {rows} | {base:.1} | {fused:.1} | {:+.1}% | {sync:.1} | {:+.1}% |",
            (fused / base - 1.0) * 100.0,
            (sync / base - 1.0) * 100.0
        );
    }
    drop(mapped);
    Ok(())
}
