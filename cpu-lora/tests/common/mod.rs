//! Shared fixtures: a host store with seeded adapters (f32 copies kept for the oracle), a
//! pool of `thaw-lora-worker` processes, and the `thaw_kernels::cpu::sgmv` oracle.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_cpu_lora::{CalibrationShape, LoraJob, LoraPool, PoolConfig};
use thaw_ipc::*;
use thaw_kernels::cpu::{sgmv, LoraRef, LoraSegment};

pub const MAX_ROWS: u32 = 64;
pub const STRIDE_IN: u32 = 256;
pub const STRIDE_OUT: u32 = 256;

/// An adapter's shape: its modules' (d_in, d_out), one rank, one dtype.
#[derive(Debug, Clone)]
pub struct AdapterSpec {
    pub rank: u32,
    pub dtype: DType,
    pub layers: u32,
    pub modules: Vec<(Module, u32, u32)>,
}

/// f32 (up-converted) weights of every (adapter, layer, module), for the oracle.
pub struct Weights {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub rank: usize,
    pub scale: f32,
    pub d_in: usize,
    pub d_out: usize,
}

pub struct Fixture {
    pub pool: LoraPool,
    pub handles: Vec<AdapterHandle>,
    pub weights: WeightMap,
    pub rng: ChaCha8Rng,
}

pub fn worker_exe() -> std::path::PathBuf {
    env!("CARGO_BIN_EXE_thaw-lora-worker").into()
}

fn cores(n: usize) -> Vec<usize> {
    let ids: Vec<usize> = core_affinity::get_core_ids()
        .unwrap()
        .iter()
        .map(|c| c.id)
        .collect();
    (0..n).map(|i| ids[i % ids.len()]).collect()
}

/// A config for `n` test workers with the given strategy.
pub fn config(n: usize, wait: WaitStrategy) -> PoolConfig {
    PoolConfig {
        cores: Some(cores(n)),
        program: Some(worker_exe()),
        leading_args: vec![],
        exchange: ExchangeConfig {
            max_workers: n as u32,
            max_jobs: 64,
            max_inputs: 2,
            max_rows: MAX_ROWS,
            max_d_in: STRIDE_IN,
            max_d_out: STRIDE_OUT,
        },
        wait,
        calibration: vec![CalibrationShape {
            rank: 16,
            hidden: 256,
            rows: 8,
        }],
        startup_timeout: Duration::from_secs(20),
        ..PoolConfig::default()
    }
}

fn to_bytes(v: &[f32], dtype: DType) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        DType::F32 => (bytemuck::cast_slice(v).to_vec(), v.to_vec()),
        DType::F16 => {
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let up = h.iter().map(|x| x.to_f32()).collect();
            (bytemuck::cast_slice(&h).to_vec(), up)
        }
        DType::BF16 => {
            let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            let up = h.iter().map(|x| x.to_f32()).collect();
            (bytemuck::cast_slice(&h).to_vec(), up)
        }
    }
}

/// f32 weights by (adapter index, layer, module).
pub type WeightMap = HashMap<(usize, u32, Module), Weights>;

pub fn store_with(
    specs: &[AdapterSpec],
    seed: u64,
) -> (HostStore, Vec<AdapterHandle>, WeightMap, ChaCha8Rng) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut store = HostStore::create_with(StoreConfig {
        capacity_bytes: 64 << 20,
        max_adapters: 32,
        max_readers: 8,
    })
    .unwrap();
    let mut handles = vec![];
    let mut weights = HashMap::new();
    for (ai, s) in specs.iter().enumerate() {
        let mut bytes = vec![];
        for layer in 0..s.layers {
            for &(m, d_in, d_out) in &s.modules {
                let r = s.rank as usize;
                let a: Vec<f32> = (0..r * d_in as usize)
                    .map(|_| rng.random_range(-0.5..0.5))
                    .collect();
                let b: Vec<f32> = (0..d_out as usize * r)
                    .map(|_| rng.random_range(-0.5..0.5))
                    .collect();
                let scale = 2.0 / s.rank as f32 + ai as f32 * 0.125;
                let (ab, au) = to_bytes(&a, s.dtype);
                let (bb, bu) = to_bytes(&b, s.dtype);
                bytes.push((layer, m, scale, ab, bb));
                weights.insert(
                    (ai, layer, m),
                    Weights {
                        a: au,
                        b: bu,
                        rank: r,
                        scale,
                        d_in: d_in as usize,
                        d_out: d_out as usize,
                    },
                );
            }
        }
        let lm: Vec<LayerModuleWeights<'_>> = bytes
            .iter()
            .map(|(layer, m, scale, ab, bb)| LayerModuleWeights {
                layer: LayerIdx(*layer),
                module: *m,
                rank: s.rank,
                scale: *scale,
                dtype: s.dtype,
                a_bytes: ab,
                b_bytes: bb,
            })
            .collect();
        handles.push(
            store
                .insert(AdapterId(100 + ai as u64), Generation(1), &lm)
                .unwrap(),
        );
    }
    (store, handles, weights, rng)
}

impl Fixture {
    pub fn new(cfg: PoolConfig, specs: &[AdapterSpec], seed: u64) -> Self {
        let (store, handles, weights, rng) = store_with(specs, seed);
        let pool = LoraPool::new(cfg, store).expect("pool starts");
        Self {
            pool,
            handles,
            weights,
            rng,
        }
    }

    /// Fills rows `rows` of `input` with fresh random values of width `d_in`; returns them
    /// packed.
    pub fn fill_input(&mut self, input: u32, rows: std::ops::Range<u32>, d_in: usize) -> Vec<f32> {
        let x: Vec<f32> = (0..rows.len() * d_in)
            .map(|_| self.rng.random_range(-1.0..1.0))
            .collect();
        self.pool.write_input(input, rows.start, &x, d_in).unwrap();
        x
    }

    /// Checks every module of `job` (adapter index `ai`) against the oracle; `x` holds the
    /// job's input rows packed at the module's d_in.
    pub fn check_job(&self, ai: usize, job: &LoraJob, x: &[f32]) {
        for m in job.modules.iter() {
            let w = &self.weights[&(ai, job.layer.0, m)];
            let rows = job.rows.len();
            let want = oracle(&x[..rows * w.d_in], w);
            let got_strided = self.pool.output(m, job.rows.clone()).unwrap();
            let stride = self.pool.output_stride();
            let got: Vec<f32> = got_strided
                .chunks_exact(stride)
                .flat_map(|r| r[..w.d_out].iter().copied())
                .collect();
            let err = rel_err(&got, &want);
            assert!(
                err <= 1e-5,
                "adapter {ai} layer {} {m:?} rows {:?}: rel err {err:e}",
                job.layer.0,
                job.rows
            );
        }
    }

    pub fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }
}

/// Δ from `thaw_kernels::cpu::sgmv` on the f32 (up-converted) weights.
pub fn oracle(x: &[f32], w: &Weights) -> Vec<f32> {
    let rows = x.len() / w.d_in;
    let mut y = vec![0.0; rows * w.d_out];
    let seg = LoraSegment {
        rows: 0..rows,
        lora: LoraRef {
            a: &w.a,
            b: &w.b,
            rank: w.rank,
            scale: w.scale,
        },
    };
    let mut scratch = vec![];
    sgmv(x, w.d_in, &[seg], &mut y, w.d_out, &mut scratch);
    y
}

/// Normwise relative error ‖got − want‖₂ / ‖want‖₂ (f64 accumulation).
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    assert!(den > 0.0, "oracle is all zeros");
    if num.is_nan() {
        return f64::INFINITY;
    }
    (num / den).sqrt()
}

/// Standard adapters: one per dtype, q/v at full width plus a narrower k (d_out 128) and an
/// o with d_in 192 < stride (exercises packing both ways).
pub fn standard_specs() -> Vec<AdapterSpec> {
    let mods = vec![
        (Module::Q, 256, 256),
        (Module::K, 256, 128),
        (Module::V, 256, 256),
        (Module::O, 192, 256),
    ];
    vec![
        AdapterSpec {
            rank: 8,
            dtype: DType::F32,
            layers: 2,
            modules: mods.clone(),
        },
        AdapterSpec {
            rank: 16,
            dtype: DType::F16,
            layers: 2,
            modules: mods.clone(),
        },
        AdapterSpec {
            rank: 32,
            dtype: DType::BF16,
            layers: 2,
            modules: mods,
        },
    ]
}

pub fn qkv() -> ModuleMask {
    [Module::Q, Module::K, Module::V].into_iter().collect()
}
