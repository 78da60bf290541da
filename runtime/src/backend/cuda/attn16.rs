//! 16-bit attention inputs (issue 29, `THAW_CUDA_BF16_ACT`, the MLP's switch; on by default,
//! `0` off): `thaw_kernels`' `attn16.cu`.
//!
//! Where [`attn16_plan`] serves a step's layer, [`Backend::qkv_attention`] runs
//! 1. the input's 16-bit copy: the fused add + RMSNorm's where its [`X16Tag`] serves, else a
//!    cast of `x` (as [`Gpu::linear`](super::launch::Gpu) casts);
//! 2. the q, k and v GEMMs with their outputs stored in the weight dtype ([`Gpu::gemm16`]:
//!    cuBLASLt where it is on, else cublasGemmEx; f32 accumulation, one rounding on the store);
//! 3. `qkv_rope16_A_T`: RoPE of the 16-bit q and k in f32 (`write_kv_rope`'s angles and
//!    arithmetic, from the header both compile), the rotated q into the f32 `q` every attention
//!    kernel reads, K and V into the paged cache in the KV dtype — RoPE folded into the KV
//!    write whether or not `THAW_CUDA_ROPE_FOLD` is on;
//! 4. the attention kernels the f32 path runs (eager: [`CudaBackend::attend`]; graph: the
//!    graph's decode). Where the plan `stores_out16` (no LoRA on o may read the output, the
//!    family launched has the store) their 16-bit-output entries write it in the weight dtype
//!    into the 16-bit GEMM input scratch, tagged as `ws.attn`'s cast, so o_proj's product reads
//!    it with no cast and `ws.attn`'s f32 values are not written (`attn_out.rs`); else their
//!    f32 output is o_proj's input, which o_proj casts.
//!
//! Against the f32 path (q, k, v written and read in f32, q and k written back by RoPE; the
//! output written in f32, cast and read) this moves 12q + 8kv bytes a row against 24q + 20kv,
//! 48 % for Llama-3-8B, or 20q + 8kv with the output in f32
//! ([`attn16_traffic_bytes`](crate::backend::attn16_plan::attn16_traffic_bytes)), and launches
//! three kernels fewer a layer (RoPE of q, of k and the KV write as one; no cast). CUDA-graph
//! steps whose key has no LoRA rank class take this path too; the three 16-bit q/k/v buffers
//! and the shared 16-bit GEMM input scratch are reserved at the graphs' largest before a
//! capture and are part of the graph fingerprint. LoRA on q/k/v (a graph: a
//! key with a rank class), GEMV-sized products, biased q/k/v (Qwen2) and f32 weights keep the
//! f32 path. CPU twin of the rounding: `cpu_attn16.rs`.
//!
//! [`attn16_plan`]: crate::backend::attn16_plan::attn16_plan
//! [`Backend::qkv_attention`]: crate::backend::Backend::qkv_attention
//! [`X16Tag`]: super::fused::X16Tag
use cudarc::driver::{CudaFunction, CudaSlice};
use thaw_kernels::cuda::registry::{shape, DType};
use thaw_kernels::cuda::KernelCache;

use super::act16::grown;
use super::attn_out::AttnOut;
use super::launch::{int, launch, Gpu};
use super::weights::{CudaLinear, CudaLora};
use super::wide::FoldShape;
use super::{CudaBackend, CudaError, CudaKvLayer};
use crate::backend::attn16_plan::{attn16_plan, Attn16Facts, Attn16Plan};
use crate::backend::cpu_attn16::{attn16_facts, lora_on_o, lora_on_qkv, q_kv};
use crate::backend::kernel_select::wide_rope_block;
use crate::backend::{LoraBatch, LoraSite, StepLayout};
use crate::error::Result;

/// The kernel for this backend's (weight, KV) dtypes, loaded on first use, and the 16-bit q, k
/// and v products, grown to the largest step seen (no allocation in a steady step).
#[derive(Default)]
pub(super) struct Attn16 {
    kernel: Option<CudaFunction>,
    q: Option<CudaSlice<u16>>,
    k: Option<CudaSlice<u16>>,
    v: Option<CudaSlice<u16>>,
}

/// The 16-bit q/k/v buffers `qkv_rope16` reads, and where it writes.
struct Rope16<'a> {
    qkv16: [&'a CudaSlice<u16>; 3],
    q: &'a mut CudaSlice<f32>,
    caches: (&'a mut CudaSlice<u8>, &'a mut CudaSlice<u8>),
}

impl Gpu {
    /// `qkv_rope16_A_T` over `s.rows` rows: q and k rotated for `positions`, the rotated q into
    /// `r.q` (f32), the rotated k and v into cache slots `slots` (KV dtype).
    fn qkv_rope16(
        &self,
        kernel: &CudaFunction,
        r: Rope16<'_>,
        slots: &impl cudarc::driver::DevicePtr<u32>,
        positions: &impl cudarc::driver::DevicePtr<u32>,
        inv_freq: &CudaSlice<f32>,
        s: FoldShape,
    ) -> Result<(), CudaError> {
        let (q_len, token_len) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let [q16, k16, v16] = r.qkv16;
        assert!(
            q16.len() >= s.rows * q_len
                && k16.len() >= s.rows * token_len
                && v16.len() >= s.rows * token_len
                && r.q.len() >= s.rows * q_len
                && slots.len() >= s.rows
                && positions.len() >= s.rows,
            "qkv_rope16: buffers too small"
        );
        assert!(
            inv_freq.len() * 2 == s.head_dim && s.head_dim <= 2 * shape::ROPE_MAX_HALF,
            "qkv_rope16: inv_freq is not head_dim / 2, or head_dim is above the staged table"
        );
        if s.rows == 0 {
            return Ok(());
        }
        let threads = wide_rope_block((s.n_heads + s.n_kv_heads) * s.head_dim / 2);
        // SAFETY: qkv_rope16_A_T(const A* q16, const A* k16, const A* v16, float* q, T* kc,
        // T* vc, const u32* slots, const u32* positions, const float* inv_freq, int rows,
        // int n_heads, int n_kv_heads, int head_dim); one block per row of at most 1024 threads
        // (its launch bounds); q16, k16, v16 and q hold `rows` rows (checked above) and the
        // slots address whole token rows inside the caches (built from the block tables, as
        // for write_kv_rope); inv_freq fits the kernel's shared table (checked above).
        unsafe {
            launch!(
                self,
                kernel,
                (s.rows as u32, 1, 1),
                threads,
                [
                    self.p(q16),
                    self.p(k16),
                    self.p(v16),
                    self.p(r.q),
                    self.p(r.caches.0),
                    self.p(r.caches.1),
                    self.p(slots),
                    self.p(positions),
                    self.p(inv_freq),
                    int(s.rows, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim")
                ]
            )
        }
    }
}

impl CudaBackend {
    /// The plan of the attention input at `sites[0].layer` for a step of `rows` rows over `ws`
    /// (in a CUDA graph: the key's rank class, not `batch`, decides the LoRA fact).
    pub fn attn16_plan_for(
        &self,
        ws: [&CudaLinear; 3],
        rows: usize,
        sites: &[LoraSite; 3],
        heads: (usize, usize),
        batch: &LoraBatch<'_, CudaLora>,
    ) -> Attn16Plan {
        let graph = self.graphs.active();
        let rank = |a: &CudaLora, l, m| a.rank(l, m);
        let lora = graph.is_none() && lora_on_qkv(batch, sites[0].layer, rank);
        let bias = ws.iter().any(|w| w.bias.is_some());
        let facts = Attn16Facts {
            switch_on: self.gpu.act16.is_some(),
            weights_16bit: self.gpu.weight_dtype != DType::F32,
            graph: graph.is_some(),
            graph_lora: graph.is_some_and(|a| a.key.lora_rank > 0),
            // o_proj's product has q's shape, so q/k/v's shapes decide for the block.
            gemv: self
                .gpu
                .gemv_may_take(rows, ws.iter().map(|w| (w.d_in, w.d_out))),
            lora_on_o: graph.is_none() && lora_on_o(batch, sites[0].layer, rank),
            // Counted whether or not the step has prefill rows (the tensor-core prefill is the
            // one family without a store for every dtype pair), which only keeps f32.
            out16_unserved: !(self.gpu.attn_out16.as_ref()).is_some_and(|k| k.serves(&self.gpu)),
            ..attn16_facts(rows, sites, heads, bias, lora)
        };
        attn16_plan(&facts, q_kv(sites))
    }

    /// The 16-bit path of [`Backend::qkv_attention`](crate::backend::Backend::qkv_attention)
    /// (the plan served it): the steps of the module docs as one op, `at` (the norm's tag
    /// serves the products). With `out16` the attention output goes into the 16-bit GEMM
    /// input scratch (`attn_out.rs`) and `out` is not written: the caller tags the scratch as
    /// `out`'s cast.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_qkv_attention16(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; 3],
        (n_heads, n_kv_heads): (usize, usize),
        kv: &mut CudaKvLayer,
        step: &StepLayout,
        (q, out): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
        (at, out16): (u64, bool),
    ) -> Result<(), CudaError> {
        let rows = step.rows();
        self.attn16_products(x, ws, rows, at)?;
        let s = self.attn_shape(kv);
        assert_eq!(
            (n_heads, n_kv_heads),
            (s.n_heads, s.n_kv_heads),
            "qkv_attention: head counts differ from the backend's model"
        );
        let fold = FoldShape {
            rows,
            n_heads,
            n_kv_heads,
            head_dim: self.head_dim,
        };
        let kernel = self.attn16_kernel()?;
        let graph = self.graphs.active();
        if graph.is_none() {
            self.ensure_positions(&step.positions)?;
            self.attn_prepare(step, kv)?;
        }
        let a16 = &self.attn16;
        let (Some(q16), Some(k16), Some(v16)) = (&a16.q, &a16.k, &a16.v) else {
            return Err(CudaError::Unsupported(
                "qkv_rope16 before its products".into(),
            ));
        };
        let r = Rope16 {
            qkv16: [q16, k16, v16],
            q: &mut *q,
            caches: (&mut kv.k, &mut kv.v),
        };
        let Some(a) = graph else {
            let (slots, pos) = (self.attn.slots(), self.positions.get());
            (self.gpu).qkv_rope16(&kernel, r, &slots, pos, &self.inv_freq, fold)?;
            if !out16 {
                return self.attend(q, kv, out.into(), s);
            }
            // The q/k/v GEMMs above were the scratch's last readers (stream order).
            let mut x16 = self.x16.take();
            let r = self.x16_out(&mut x16, rows * n_heads * self.head_dim);
            let r = r.and_then(|o| self.attend(q, kv, AttnOut::X16(o), s));
            self.x16 = x16;
            return r;
        };
        // A graph step: positions, slots, block tables and decode rows from the persistent
        // buffer, the graph's decode kernels.
        let (l, n) = (a.layout, a.key.bucket);
        let meta = self.graphs.meta()?;
        let slots = meta.slice(l.slots..l.slots + n);
        let pos = meta.slice(l.positions..l.positions + n);
        let fold = FoldShape { rows: n, ..fold };
        (self.gpu).qkv_rope16(&kernel, r, &slots, &pos, &self.inv_freq, fold)?;
        let tables = meta.slice(l.tables..l.len);
        let decode = meta.slice(l.decode..l.decode + 3 * n);
        if !out16 {
            return self.graph_decode(q, kv, out.into(), (&tables, &decode), n, s);
        }
        // Reserved at the graphs' largest before the capture (`graph_prepare`): no growth.
        let mut x16 = self.x16.take();
        let r = self.x16_out(&mut x16, n.max(rows) * n_heads * self.head_dim);
        let r = r.and_then(|o| self.graph_decode(q, kv, AttnOut::X16(o), (&tables, &decode), n, s));
        self.x16 = x16;
        r
    }

    /// The 16-bit GEMM input scratch as the attention output of `n` elements, grown to it
    /// first (the largest step; steady steps find it large enough).
    fn x16_out<'a>(
        &self,
        x16: &'a mut Option<CudaSlice<u16>>,
        n: usize,
    ) -> Result<&'a mut CudaSlice<u16>, CudaError> {
        // SAFETY: the attention kernels write every element of the step's rows × q_dim before
        // o_proj's GEMM reads them (the tag covers exactly those).
        unsafe { self.gpu.x16_ptr(x16, n) }?;
        Ok(x16.as_mut().expect("grown by x16_ptr"))
    }

    /// Steps 1–2: `x`'s 16-bit copy and the three 16-bit products into the scratch; op `at`.
    fn attn16_products(
        &mut self,
        x: &CudaSlice<f32>,
        ws: [&CudaLinear; 3],
        rows: usize,
        at: u64,
    ) -> Result<(), CudaError> {
        let d_in = ws[0].d_in;
        assert!(
            ws.iter().all(|w| w.d_in == d_in),
            "qkv_attention: q, k and v inputs differ"
        );
        let n_in = rows * d_in;
        assert!(x.len() >= n_in, "qkv_attention: x too small");
        // SAFETY: only the first n_in elements are asked for, and x16_input writes them.
        unsafe { self.x16_input(x, n_in, n_in, at) }?;
        let x16 = self.x16.as_ref().expect("grown by x16_input");
        let a16 = &mut self.attn16;
        for (w, buf) in ws.iter().zip([&mut a16.q, &mut a16.k, &mut a16.v]) {
            // SAFETY: the GEMM below writes all rows × d_out elements before qkv_rope16 reads.
            let out = unsafe { grown(&self.gpu, buf, rows * w.d_out) }?;
            self.gpu
                .gemm16(x16, &w.w.view(), rows, d_in, w.d_out, out)?;
        }
        Ok(())
    }

    /// The `qkv_rope16` kernel of this backend's dtypes, compiled on first use (an eager step's:
    /// a graph's warm-up runs eagerly before any capture).
    fn attn16_kernel(&mut self) -> Result<CudaFunction, CudaError> {
        if let Some(k) = &self.attn16.kernel {
            return Ok(k.clone());
        }
        let name = format!(
            "qkv_rope16_{}_{}",
            self.gpu.weight_dtype.suffix(),
            self.gpu.kv_dtype.suffix()
        );
        let k = KernelCache::global().function(&self.gpu.ctx, &name)?;
        self.attn16.kernel = Some(k.clone());
        Ok(k)
    }

    /// Grows the 16-bit q/k/v scratch to `n` elements each (a graph's largest, before a
    /// capture: a captured graph bakes their addresses in) and loads the kernel; nothing with
    /// the switch off.
    pub(super) fn attn16_reserve(&mut self, n: usize) -> Result<(), CudaError> {
        if self.gpu.act16.is_none() {
            return Ok(());
        }
        self.attn16_kernel()?;
        let a = &mut self.attn16;
        for buf in [&mut a.q, &mut a.k, &mut a.v] {
            // SAFETY: the scratch is written by the 16-bit GEMMs before qkv_rope16 reads it.
            unsafe { grown(&self.gpu, buf, n) }?;
        }
        Ok(())
    }

    /// The 16-bit q/k/v scratch addresses a captured graph reads (0 with the switch off, so
    /// switching it changes the graph fingerprint).
    pub(super) fn attn16_addrs(&self) -> [u64; 3] {
        let a = &self.attn16;
        let p = |b: &Option<CudaSlice<u16>>| match (&self.gpu.act16, b) {
            (Some(_), Some(b)) => self.gpu.p(b),
            _ => 0,
        };
        [p(&a.q), p(&a.k), p(&a.v)]
    }

    /// `qkv_rope16_A_T` over host q, k, v (bit patterns of the weight dtype, `[rows, heads,
    /// head_dim]`) at `positions`, row r into cache slot r: the rotated q (f32) and the K and
    /// V cache rows widened to f32 (parity tests and benchmarks; synchronises). Needs the
    /// switch on and a 16-bit weight dtype.
    pub fn qkv_rope16_host(
        &mut self,
        [q, k, v]: [&[u16]; 3],
        positions: &[usize],
    ) -> Result<[Vec<f32>; 3]> {
        let rows = positions.len();
        let (q_len, token_len) = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        assert!(
            q.len() == rows * q_len && k.len() == rows * token_len && v.len() == rows * token_len,
            "qkv_rope16_host: q/k/v are not rows × heads × head_dim"
        );
        let kernel = self.attn16_kernel()?;
        let g = &self.gpu;
        let dev16 = |h: &[u16]| -> Result<CudaSlice<u16>, CudaError> {
            let mut d = g.alloc_zeros::<u16>(h.len().max(1))?;
            if !h.is_empty() {
                g.htod(h, &mut d)?;
            }
            Ok(d)
        };
        let dev32 = |h: &[u32]| -> Result<CudaSlice<u32>, CudaError> {
            let mut d = g.alloc_zeros::<u32>(h.len().max(1))?;
            if !h.is_empty() {
                g.htod(h, &mut d)?;
            }
            Ok(d)
        };
        let (q16, k16, v16) = (dev16(q)?, dev16(k)?, dev16(v)?);
        let slots: Vec<u32> = (0..rows as u32).collect();
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let (slots, pos) = (dev32(&slots)?, dev32(&pos)?);
        let kv_bytes = (rows * token_len).max(1) * g.kv_dtype.size();
        let (mut kc, mut vc) = (
            g.alloc_zeros::<u8>(kv_bytes)?,
            g.alloc_zeros::<u8>(kv_bytes)?,
        );
        let mut qd = g.alloc_zeros::<f32>((rows * q_len).max(1))?;
        let r = Rope16 {
            qkv16: [&q16, &k16, &v16],
            q: &mut qd,
            caches: (&mut kc, &mut vc),
        };
        let fold = FoldShape {
            rows,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        };
        g.qkv_rope16(&kernel, r, &slots, &pos, &self.inv_freq, fold)?;
        let widen = |c: &CudaSlice<u8>| -> Result<Vec<f32>, CudaError> {
            let mut h = vec![0u8; kv_bytes];
            g.dtoh(c, &mut h[..])?;
            g.sync()?;
            Ok(widen_kv(
                g.kv_dtype,
                &h[..rows * token_len * g.kv_dtype.size()],
            ))
        };
        let (kh, vh) = (widen(&kc)?, widen(&vc)?);
        Ok([self.download_f32(&qd, rows * q_len)?, kh, vh])
    }
}

/// Little-endian cache bytes of `dtype` as f32 values.
fn widen_kv(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}
