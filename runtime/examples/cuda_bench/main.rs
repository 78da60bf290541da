//! CUDA microbenchmarks (issue 6): SGMV / BGMV latency and achieved bandwidth (`lora.cu` and
//! the Punica-shaped `lora_punica.cu`, issue 29), decode attention (one block per head and
//! flash-decoding, issue 29), export + merge
//! overhead per layer, fused export vs synchronous copy-then-signal, H2D adapter streaming vs
//! the pinned-copy peak. Prints tables; asserts no timing.
//!
//! ```text
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench          # full
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench -- --smoke
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench -- --attn   # attention only
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench -- --gemv   # GEMV only
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench -- --lora-slices
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench -- --lt     # cuBLASLt only
//! cargo run --release -p thaw-runtime --features cuda --example cuda_bench -- --act16
//! ```
//!
//! `--attn`: only issue 29's attention tables, full size: decode attention (classic vs
//! flash-decoding vs the occupancy decode, the default, `decode_attn.rs`) and prefill attention (classic vs tensor cores, `prefill_attn.rs`).
//!
//! `--gemv`: only the products-of-few-rows table (`gemv.rs`): cast + cuBLAS against the
//! small-batch GEMV (the default) at rows 1, 2, 4 and 8 on Llama-7B's decode shapes.
//!
//! `--lora-slices`: only the q/k/v and gate/up LoRA table (`slices.rs`): a launch pair per
//! module against one pair per group (the default) at rows 1, 16 and 64, ranks 16 and 64.
//!
//! `--lt`: only the products table (`lt.rs`): `cublasGemmEx` against cuBLASLt (the default)
//! products (bias in the epilogue) at rows 1, 8, 32, 128 and 2048 on Llama-7B's shapes.
//!
//! `--act16`: only the 16-bit activations' tables (the default; `THAW_CUDA_BF16_ACT=0` off) at rows 1,
//! 32, 128 and 2048: the MLP block (`act16.rs`), the attention input (`attn16.rs`) and the
//! residual add + RMSNorm (`residual16.rs`), each against f32.
mod act16;
mod attn16;
mod decode_attn;
mod gemv;
mod lt;
mod prefill;
mod prefill_attn;
mod residual16;
mod slices;

use std::time::Instant;

use thaw_ipc::{Exchange, ExchangeConfig, StepSeq, WorkerId, WORKER_RESULT};
use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::cuda::{
    cuda_available, CudaBackend, CudaConfig, CudaLora, DType, LoraImpl,
};
use thaw_runtime::backend::{Backend, LinearDims, LoraKernel};
use thaw_runtime::microbench::fill;
use thaw_runtime::microbench::{
    run_lora_case, synthetic_adapter, ElemSizes, LoraCase, Popularity, LORA_TABLE_HEADER,
};
use thaw_runtime::model::ModelConfig;
use thaw_runtime::RuntimeError;

/// bf16 adapters (the default weight dtype), f32 activations.
const ELEMS: ElemSizes = ElemSizes { adapter: 2, act: 4 };

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn model_config(layers: usize) -> Res<ModelConfig> {
    Ok(ModelConfig::from_json(&format!(
        r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
        "intermediate_size":14336,"num_attention_heads":32,"num_key_value_heads":8,
        "num_hidden_layers":{layers},"vocab_size":32000,"rms_norm_eps":1e-5,"rope_theta":500000.0,
        "max_position_embeddings":8192}}"#
    ))?)
}

/// Median of `iters` timed runs of `f` on the backend's stream, in µs (events around each).
fn time_us(g: &mut CudaBackend, iters: usize, mut f: impl FnMut(&mut CudaBackend)) -> Res<f64> {
    f(g);
    g.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters {
        let s = g.stream().record_event(Some(cudarc_flags()))?;
        f(g);
        let e = g.stream().record_event(Some(cudarc_flags()))?;
        e.synchronize()?;
        t.push(s.elapsed_ms(&e)? as f64 * 1e3);
    }
    g.check()?;
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[t.len() / 2])
}

fn cudarc_flags() -> cudarc::driver::sys::CUevent_flags {
    cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT
}

/// Device-to-device copy bandwidth of a 1 GiB buffer, counting bytes read plus written: the
/// HBM ceiling the LoRA kernels are measured against.
fn d2d_peak(g: &mut CudaBackend) -> Res<f64> {
    let n = 256usize << 20;
    let a = g.upload_f32(&fill(n, 5))?;
    let mut b = g.alloc(n)?;
    let us = time_us(g, 10, |g| {
        g.stream()
            .memcpy_dtod(&a, &mut b)
            .expect("device-to-device copy");
    })?;
    Ok(2.0 * (n * 4) as f64 / us / 1e3)
}

fn lora_tables(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    println!(
        "device: {} (weights bf16, activations f32)",
        g.device_name()
    );
    let peak = d2d_peak(&mut g)?;
    println!("device-to-device copy peak (1 GiB, read + write): {peak:.0} GB/s");
    println!("\n## SGMV / BGMV, q_proj 4096→4096, one layer (kernels only, median of 20; GB/s = distinct adapter bytes + x/y over time)");
    println!("(impl: Classic = lora.cu, THAW_CUDA_LORA_IMPL=classic; Punica = lora_punica.cu, the default)");
    println!("{LORA_TABLE_HEADER}");
    let ranks: &[usize] = if smoke { &[16] } else { &[8, 16, 32, 64, 128] };
    let batches: &[usize] = if smoke {
        &[1, 8]
    } else {
        &[1, 2, 4, 8, 16, 32, 64]
    };
    let pool = if smoke { 8 } else { 64 };
    let (d_in, d_out) = (4096usize, 4096usize);
    let x = g.upload_f32(&fill(64 * d_in, 1))?;
    let mut y = g.upload_f32(&fill(64 * d_out, 2))?;
    for &rank in ranks {
        let adapters: Vec<CudaLora> = (0..pool)
            .map(|i| {
                g.upload_lora(synthetic_adapter(
                    &c,
                    rank,
                    &[LoraModule::Q],
                    10 + i as u64,
                )?)
                .map_err(Into::into)
            })
            .collect::<Res<_>>()?;
        for (imp, kernel) in [LoraImpl::Classic, LoraImpl::PUNICA]
            .into_iter()
            .flat_map(|i| [LoraKernel::Sgmv, LoraKernel::Bgmv].map(|k| (i, k)))
        {
            g.set_lora_impl(imp)?;
            for &batch in batches {
                for popularity in Popularity::ALL {
                    let case = LoraCase {
                        kernel,
                        rank,
                        batch,
                        popularity,
                        dims: LinearDims { d_in, d_out },
                    };
                    // A new step: time_us's warm-up call uploads this layout's segment
                    // metadata (once per step in the engine, shared by every layer); the timed
                    // calls are the kernels alone.
                    let r =
                        run_lora_case(&mut g, &x, &mut y, &adapters, case, ELEMS, &mut |g, f| {
                            g.begin_step();
                            time_us(g, 20, f).map_err(|e| RuntimeError::Backend(e.to_string()))
                        })?;
                    println!("{}", r.markdown_row(&format!("{imp:?}"), peak));
                }
            }
        }
    }
    Ok(())
}

fn exchange_tables(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(
        &c,
        &CudaConfig {
            weight_dtype: DType::Bf16,
            ..Default::default()
        },
    )?;
    let ex = Exchange::create(ExchangeConfig {
        max_workers: 4,
        max_rows: 128,
        max_d_in: 14336,
        max_d_out: 14336,
        ..Default::default()
    })?;
    let mapped = g.map_exchange(&ex)?;
    let l = *ex.layout();
    println!("\n## CPU-assist exchange per layer (hidden 4096; q,k,v deltas merged; workers pre-completed: result words 2^30 so only GPU-side cost shows)");
    println!("| rows | fused export µs | sync copy-then-signal µs | export+3 merges µs |\n|---|---|---|---|");
    let x = g.upload_f32(&fill(128 * 4096, 3))?;
    let mut y = g.upload_f32(&fill(128 * 4096, 4))?;
    let mut seq = 1u32;
    for &rows in if smoke {
        &[16usize][..]
    } else {
        &[1, 16, 64, 128][..]
    } {
        let sel: Vec<usize> = (0..rows).collect();
        for w in 0..4u32 {
            ex.segment()
                .atomic_u32(l.workers + w as usize * 64 + WORKER_RESULT)
                .store(1 << 30, std::sync::atomic::Ordering::SeqCst);
        }
        let fused = time_us(&mut g, 50, |g| {
            seq += 1;
            let _ = g.export_rows_fused(&mapped, &x, 4096, &sel, 0, StepSeq(seq));
        })?;
        let mut host = vec![0.0f32; rows * 4096];
        let t0 = Instant::now();
        let iters = 50;
        for _ in 0..iters {
            g.export_rows(&x, 4096, std::slice::from_ref(&(0..rows)), &mut host, 4096);
            seq += 1;
            ex.seq_word()
                .store(seq, std::sync::atomic::Ordering::SeqCst);
        }
        g.check()?;
        let sync_us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let both = time_us(&mut g, 50, |g| {
            seq += 1;
            let _ = g.export_rows_fused(&mapped, &x, 4096, &sel, 0, StepSeq(seq));
            for m in [LoraModule::Q, LoraModule::K, LoraModule::V] {
                let _ = g.merge_deltas_waited(
                    &mapped,
                    &mut y,
                    4096,
                    m,
                    &sel,
                    StepSeq(seq),
                    &[WorkerId(0), WorkerId(1)],
                );
            }
        })?;
        println!("| {rows} | {fused:.1} | {sync_us:.1} (host wall) | {both:.1} |");
    }
    drop(mapped);
    Ok(())
}

fn streaming_table(smoke: bool) -> Res<()> {
    let layers = if smoke { 2 } else { 8 };
    let c = model_config(layers)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    println!(
        "\n## H2D adapter streaming, rank 64, all 7 modules, {layers} layers, bf16 (median of 3)"
    );
    let a = synthetic_adapter(&c, 64, &LoraModule::ALL, 77)?;
    let bytes: usize = a
        .iter()
        .map(|(_, _, w)| (w.a.numel() + w.b.numel()) * 2)
        .sum();
    let (mut pack, mut copy) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t0 = Instant::now();
        let lora = g.stream_lora(a.clone())?;
        let t1 = Instant::now();
        while g.landed_layers(&lora) < layers {
            std::hint::spin_loop();
        }
        pack.push(t1.duration_since(t0).as_secs_f64());
        copy.push(t1.elapsed().as_secs_f64());
    }
    pack.sort_by(f64::total_cmp);
    copy.sort_by(f64::total_cmp);
    // Pinned peak: pinned → device copies of the same size.
    let ctx = g.stream().context().clone();
    // SAFETY: the pinned buffer's contents are irrelevant to a bandwidth measurement.
    let pinned = unsafe { ctx.alloc_pinned::<u8>(bytes) }?;
    let mut dst = g.stream().alloc_zeros::<u8>(bytes)?;
    let mut peak = Vec::new();
    for _ in 0..4 {
        let t = Instant::now();
        g.stream().memcpy_htod(&pinned, &mut dst)?;
        g.stream().synchronize()?;
        peak.push(t.elapsed().as_secs_f64());
    }
    peak.sort_by(f64::total_cmp);
    let link = g.measure_link()?;
    println!("| bytes | pin + pack on host ms | copy after pack GB/s | end to end GB/s | pinned peak GB/s | measured link (64 MiB) |\n|---|---|---|---|---|---|");
    println!(
        "| {bytes} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} GB/s, {:.0} µs |",
        pack[1] * 1e3,
        bytes as f64 / copy[1] / 1e9,
        bytes as f64 / (pack[1] + copy[1]) / 1e9,
        bytes as f64 / peak[1] / 1e9,
        link.gbps,
        link.latency_us
    );
    Ok(())
}

/// The flags cuda_bench takes (`benches/gpu/dryrun.py` checks the GPU scripts' calls against
/// this list where no cuda_bench was built).
const FLAGS: [&str; 6] = [
    "--smoke",
    "--attn",
    "--gemv",
    "--lora-slices",
    "--lt",
    "--act16",
];

fn main() -> Res<()> {
    // A misspelt flag must not start the full run (minutes of a short GPU lease); `--help`
    // after the flags checks them without a GPU.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bad) = args
        .iter()
        .find(|a| !FLAGS.contains(&a.as_str()) && !matches!(a.as_str(), "--help" | "-h"))
    {
        eprintln!(
            "error: cuda_bench does not take {bad}; it takes {} (or none: every table)",
            FLAGS.join(", ")
        );
        std::process::exit(2);
    }
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: cuda_bench [{}] (see the example's module docs)",
            FLAGS.join("] [")
        );
        return Ok(());
    }
    let smoke = std::env::args().any(|a| a == "--smoke");
    if !cuda_available() {
        println!("skipped: no NVIDIA GPU / libcuda on this machine");
        return Ok(());
    }
    let attn_only = std::env::args().any(|a| a == "--attn");
    if std::env::args().any(|a| a == "--lora-slices") {
        return slices::slices_table(smoke);
    }
    if std::env::args().any(|a| a == "--lt") {
        return lt::lt_table(smoke);
    }
    if std::env::args().any(|a| a == "--act16") {
        act16::act16_table(smoke)?;
        return attn16::attn16_table(smoke);
    }
    if std::env::args().any(|a| a == "--gemv") {
        let mut g = CudaBackend::new(&model_config(1)?, &CudaConfig::default())?;
        let peak = d2d_peak(&mut g)?;
        println!("device: {}", g.device_name());
        println!("device-to-device copy peak (1 GiB, read + write): {peak:.0} GB/s");
        drop(g);
        return gemv::gemv_table(smoke, peak);
    }
    if !attn_only {
        lora_tables(smoke)?;
        slices::slices_table(smoke)?;
    }
    {
        let mut g = CudaBackend::new(&model_config(1)?, &CudaConfig::default())?;
        let peak = d2d_peak(&mut g)?;
        drop(g);
        decode_attn::decode_attn_table(smoke && !attn_only, peak)?;
        if !attn_only {
            gemv::gemv_table(smoke, peak)?;
            lt::lt_table(smoke)?;
            act16::act16_table(smoke)?;
            attn16::attn16_table(smoke)?;
        }
    }
    prefill_attn::prefill_attn_table(smoke && !attn_only)?;
    if attn_only {
        return Ok(());
    }
    exchange_tables(smoke)?;
    prefill::prefill_table(smoke)?;
    streaming_table(smoke)?;
    Ok(())
}
