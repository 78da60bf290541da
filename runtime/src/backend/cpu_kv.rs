//! The CPU backend's KV cache storage: f32 (`--kv-cache-dtype auto`, as before) or 16 bits a
//! value (`fp16`, `bf16`: half the memory and half the bytes a decode step reads, as
//! llama.cpp's default f16 cache).
//!
//! New K/V rows are rounded to the 16-bit format as they are written; attention widens a
//! sequence's rows back to f32 (exactly) into a per-thread buffer, block by block in the
//! sequence's order, and runs the f32 kernels over it with the identity block table. So a
//! 16-bit cache computes bit for bit what an f32 cache holding the rounded values computes,
//! and accumulates in f32 as before.
use std::fmt;
use std::str::FromStr;

use thaw_kernels::cpu::{self as k, FloatFormat, KvLayout};

/// How the CPU backend stores K and V (vLLM's `--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The backend's own: f32 on the CPU (the CUDA backend keeps its KV in bf16).
    #[default]
    Auto,
    /// IEEE binary16, round to nearest even.
    Fp16,
    /// bfloat16, round to nearest even.
    Bf16,
}

impl KvCacheDtype {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
        }
    }

    /// The element format of the CPU backend's cache.
    pub fn cpu_format(self) -> FloatFormat {
        match self {
            Self::Auto => FloatFormat::F32,
            Self::Fp16 => FloatFormat::F16,
            Self::Bf16 => FloatFormat::BF16,
        }
    }
}

impl FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "fp16" | "float16" | "half" | "f16" => Ok(Self::Fp16),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => Err(format!(
                "unknown KV cache dtype `{other}`; use auto, fp16 or bf16"
            )),
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One layer's K (or V) values, `[num_blocks, block_size, num_kv_heads, head_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub enum KvData {
    F32(Vec<f32>),
    /// f16 or bf16 bit patterns.
    Half(FloatFormat, Vec<u16>),
}

impl KvData {
    /// `len` zero values in `format`.
    pub(super) fn zeros(format: FloatFormat, len: usize) -> Self {
        match format {
            FloatFormat::F32 => Self::F32(vec![0.0; len]),
            f => Self::Half(f, vec![0; len]),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Half(_, v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// [`k::write_kv`] into either storage: `k`, `v` are `[tokens, num_kv_heads, head_dim]` f32
/// rows for positions `start_pos ..`, rounded to the cache's format.
pub(super) fn write(
    caches: (&mut KvData, &mut KvData),
    layout: KvLayout,
    table: &[u32],
    start_pos: usize,
    k: &[f32],
    v: &[f32],
) {
    match caches {
        (KvData::F32(kc), KvData::F32(vc)) => {
            k::write_kv(kc, vc, layout, table, start_pos, k, v);
        }
        (KvData::Half(f, kc), KvData::Half(_, vc)) => {
            let tl = layout.token_len();
            assert_eq!(
                k.len(),
                v.len(),
                "write_kv: k has {}, v has {}",
                k.len(),
                v.len()
            );
            for (t, (kt, vt)) in k.chunks_exact(tl).zip(v.chunks_exact(tl)).enumerate() {
                let pos = start_pos + t;
                let phys = table[pos / layout.block_size] as usize;
                let off = (phys * layout.block_size + pos % layout.block_size) * tl;
                k::narrow_kv(*f, kt, &mut kc[off..off + tl]);
                k::narrow_kv(*f, vt, &mut vc[off..off + tl]);
            }
        }
        _ => unreachable!("K and V of a layer are allocated in one format"),
    }
}

/// One sequence's K and V widened to f32, its blocks in order (logical block `i` at block
/// `i`), with the identity block table; reused while the same sequence asks again.
#[derive(Debug, Default)]
pub(super) struct Widened {
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<u32>,
    /// The sequence (index in the step) and length widened now.
    held: Option<(usize, usize)>,
}

impl Widened {
    /// Forgets what it holds (a new layer's cache).
    pub(super) fn reset(&mut self) {
        self.held = None;
    }

    /// Positions `0..end` of sequence `seq` (block table `table`) from the 16-bit caches, as
    /// f32 caches with their block table.
    pub(super) fn load(
        &mut self,
        seq: usize,
        caches: (&KvData, &KvData),
        layout: KvLayout,
        table: &[u32],
        end: usize,
    ) -> (&[f32], &[f32], &[u32]) {
        let (bs, bl, tl) = (layout.block_size, layout.block_len(), layout.token_len());
        let blocks = end.div_ceil(bs);
        if self.held != Some((seq, end)) {
            let (KvData::Half(f, kc), KvData::Half(_, vc)) = caches else {
                unreachable!("f32 caches are read in place")
            };
            self.k.resize(blocks * bl, 0.0);
            self.v.resize(blocks * bl, 0.0);
            for (b, &phys) in table[..blocks].iter().enumerate() {
                // Only the positions written so far (the last block may be partly filled).
                let n = (end - b * bs).min(bs) * tl;
                let src = phys as usize * bl;
                k::widen_kv(*f, &kc[src..src + n], &mut self.k[b * bl..b * bl + n]);
                k::widen_kv(*f, &vc[src..src + n], &mut self.v[b * bl..b * bl + n]);
            }
            self.table.clear();
            self.table.extend(0..blocks as u32);
            self.held = Some((seq, end));
        }
        (
            &self.k[..blocks * bl],
            &self.v[..blocks * bl],
            &self.table[..blocks],
        )
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn dtype_names_parse_and_reject() {
        for d in [KvCacheDtype::Auto, KvCacheDtype::Fp16, KvCacheDtype::Bf16] {
            assert_eq!(d.name().parse::<KvCacheDtype>(), Ok(d));
        }
        assert_eq!("bfloat16".parse(), Ok(KvCacheDtype::Bf16));
        assert_eq!("float16".parse(), Ok(KvCacheDtype::Fp16));
        let e = "fp8".parse::<KvCacheDtype>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("auto, fp16 or bf16"), "{e}");
    }

    proptest! {
        /// Rows written through any block table into a 16-bit cache and widened back give
        /// the rounded rows, each at its position in block order.
        #[test]
        fn written_rows_widen_to_their_rounding(
            bs in 1usize..6, heads in 1usize..3, d in 1usize..20,
            chunks in prop::collection::vec(1usize..7, 1..5), seed in any::<u32>(), bf in any::<bool>(),
        ) {
            let layout = KvLayout { block_size: bs, num_kv_heads: heads, head_dim: d };
            let tl = layout.token_len();
            let total: usize = chunks.iter().sum();
            let blocks = total.div_ceil(bs);
            // Physical blocks in reverse order, one spare at the front.
            let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 1).collect();
            let format = if bf { FloatFormat::BF16 } else { FloatFormat::F16 };
            let mut kc = KvData::zeros(format, (blocks + 1) * layout.block_len());
            let mut vc = kc.clone();
            let mut rnd = crate::backend::test_values(seed);
            let (ks, vs) = (rnd(total * tl), rnd(total * tl));
            let mut at = 0;
            for n in chunks {
                let r = at * tl..(at + n) * tl;
                write((&mut kc, &mut vc), layout, &table, at, &ks[r.clone()], &vs[r]);
                at += n;
            }
            let mut w = Widened::default();
            let (k, v, t) = w.load(0, (&kc, &vc), layout, &table, total);
            prop_assert_eq!(t.len(), blocks);
            for p in 0..total {
                let off = (t[p / bs] as usize * bs + p % bs) * tl;
                for e in 0..tl {
                    let (mut wk, mut wv) = ([0u16], [0u16]);
                    k::narrow_kv(format, &ks[p * tl + e..p * tl + e + 1], &mut wk);
                    k::narrow_kv(format, &vs[p * tl + e..p * tl + e + 1], &mut wv);
                    let (mut fk, mut fv) = ([0.0f32], [0.0f32]);
                    k::widen_kv(format, &wk, &mut fk);
                    k::widen_kv(format, &wv, &mut fv);
                    prop_assert_eq!(k[off + e].to_bits(), fk[0].to_bits());
                    prop_assert_eq!(v[off + e].to_bits(), fv[0].to_bits());
                }
            }
        }
    }

    /// Attention through the backend over a 16-bit cache — three sequences (prompt chunks of
    /// 5, 9 and 2 tokens, then three decode steps each; block tables out of order), on one
    /// and two threads — gives bit for bit what an f32 cache fed the rounded K/V gives, and
    /// stays within the rounding's bound of an f32 cache fed the exact K/V: with scores
    /// `scale·q·k` off by at most `δ = scale·Σ|q||k|·u` (`u` = 2⁻¹¹ for f16, 2⁻⁸ for bf16,
    /// half an ulp), each softmax weight moves by a factor within `e^{±2δ}`, so an output by
    /// at most `(e^{2δ} − 1 + u)·max|v|` (+1e-5 for f32 summation order).
    #[test]
    fn half_cache_attention_is_the_rounded_f32_cache() {
        use crate::backend::cpu::CpuBackend;
        use crate::backend::cpu_par::CpuThreads;
        use crate::backend::{Backend, SeqSlice, StepLayout};
        use crate::model::{fixtures, ModelConfig};
        let cfg = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let (qw, kw, d) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let layout = KvLayout {
            block_size: 4,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
        };
        let prompts = [5usize, 9, 2];
        // Sequence i owns physical blocks 3i + 2, 3i + 1, 3i (in that logical order) + spare.
        let tables: Vec<Vec<u32>> = (0..3u32)
            .map(|i| vec![3 * i + 2, 3 * i + 1, 3 * i, 9 + i])
            .collect();
        for (dtype, u) in [
            (KvCacheDtype::Fp16, 2f32.powi(-11)),
            (KvCacheDtype::Bf16, 2f32.powi(-8)),
        ] {
            for threads in [1, 2] {
                let par = CpuThreads {
                    min_part_work: 1,
                    ..CpuThreads::unpinned(threads)
                };
                let mk = |d: KvCacheDtype| {
                    CpuBackend::with_threads(&cfg, par)
                        .unwrap()
                        .with_kv_cache_dtype(d)
                };
                let (mut half, mut rounded, mut exact) =
                    (mk(dtype), mk(KvCacheDtype::Auto), mk(KvCacheDtype::Auto));
                assert_eq!(half.kv_elem_bytes(), 2);
                assert_eq!(exact.kv_elem_bytes(), 4);
                let mut kv_h = half.alloc_kv_layer(layout, 12).unwrap();
                let mut kv_r = rounded.alloc_kv_layer(layout, 12).unwrap();
                let mut kv_e = exact.alloc_kv_layer(layout, 12).unwrap();
                let mut rnd = crate::backend::test_values(threads as u32 * 7 + u.to_bits());
                let mut done = [0usize; 3];
                for step_no in 0..4 {
                    let mut step = StepLayout::default();
                    for (i, t) in tables.iter().enumerate() {
                        let n = if step_no == 0 { prompts[i] } else { 1 };
                        let r0 = step.token_ids.len();
                        let b0 = step.block_tables.len();
                        step.block_tables.extend(t);
                        step.seqs.push(SeqSlice {
                            rows: r0..r0 + n,
                            start_pos: done[i],
                            blocks: b0..b0 + t.len(),
                        });
                        step.token_ids.extend(std::iter::repeat_n(0, n));
                        step.positions.extend(done[i]..done[i] + n);
                        done[i] += n;
                    }
                    let rows = step.rows();
                    let scaled = |v: Vec<f32>| v.into_iter().map(|x| 3.0 * x).collect::<Vec<_>>();
                    let (q, kn, vn) = (
                        scaled(rnd(rows * qw)),
                        scaled(rnd(rows * kw)),
                        scaled(rnd(rows * kw)),
                    );
                    let round = |x: &[f32]| {
                        let mut h = vec![0u16; x.len()];
                        k::narrow_kv(dtype.cpu_format(), x, &mut h);
                        let mut w = vec![0.0f32; x.len()];
                        k::widen_kv(dtype.cpu_format(), &h, &mut w);
                        w
                    };
                    let (kr, vr) = (round(&kn), round(&vn));
                    let mut outs = [
                        vec![f32::NAN; rows * qw],
                        vec![f32::NAN; rows * qw],
                        vec![f32::NAN; rows * qw],
                    ];
                    half.attention(&q, &kn, &vn, &mut kv_h, &step, &mut outs[0]);
                    rounded.attention(&q, &kr, &vr, &mut kv_r, &step, &mut outs[1]);
                    exact.attention(&q, &kn, &vn, &mut kv_e, &step, &mut outs[2]);
                    let what = format!("{dtype}, {threads} thread(s), step {step_no}");
                    let same = outs[0]
                        .iter()
                        .zip(&outs[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: not the rounded f32 cache's bits");
                    // Every value (and its rounding) lies in [-1.5, 1.5].
                    let delta = d as f32 * 1.5 * 1.5 * u / (d as f32).sqrt();
                    let tol = ((2.0 * delta).exp() - 1.0 + u) * 1.5 + 1e-5;
                    let worst = outs[0]
                        .iter()
                        .zip(&outs[2])
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        worst.is_finite() && worst <= tol,
                        "{what}: |Δ| {worst} > {tol}"
                    );
                }
            }
        }
    }
}
