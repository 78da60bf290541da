//! The CPU backend's emulation of CUDA's 16-bit residual stream (`THAW_CUDA_BF16_ACT=1`,
//! [`residual16_plan`]): a test oracle of the rounding, not a speed path. With
//! [`CpuBackend::set_act16`] on, the residual `h` is rounded to the 16-bit type exactly where
//! CUDA stores it in 16 bits: after [`Backend::embed`] (a no-op for a 16-bit table of the same
//! type, which CUDA copies unwidened) and after every residual add, whose norm then reads the
//! rounded sum. `h` stays an f32 buffer holding 16-bit-exact values, so the norm and the final
//! gather read what CUDA's widening reads. The CPU's weights are f32 or 16-bit, so the plan's
//! `weights_16bit` fact is the emulation's own: on is 16 bits, as `cpu_act16` takes it.
use super::cpu::{CpuBackend, CpuLinear};
use super::residual16_plan::{residual16_plan, Residual16Facts, ResidualRepr};
use super::{Act16Type, Backend};

/// The 16-bit type the emulated residual is stored in, `None` for f32: by
/// [`residual16_plan`] over the emulation's switch.
pub(super) fn residual16(act16: Option<Act16Type>) -> Option<Act16Type> {
    let facts = Residual16Facts {
        switch_on: act16.is_some(),
        weights_16bit: act16.is_some(),
    };
    match residual16_plan(&facts) {
        ResidualRepr::Sixteen => act16,
        ResidualRepr::F32 => None,
    }
}

/// `h[r] = t[ids[r]]` widened to f32 then, in 16 bits, rounded (CUDA copies the 16-bit
/// table's rows: a no-op here for a table of that type).
pub(super) fn embed(ty: Option<Act16Type>, t: &CpuLinear, ids: &[u32], h: &mut [f32]) {
    let d = t.d_in;
    for (r, &id) in ids.iter().enumerate() {
        t.w.row_to_f32(id as usize, &mut h[r * d..(r + 1) * d]);
    }
    if let Some(ty) = ty {
        ty.round(&mut h[..ids.len() * t.d_in]);
    }
}

/// `h += x` over `len` elements, then, in 16 bits, the sum rounded (CUDA's 16-bit store).
pub(super) fn residual_add(
    b: &mut CpuBackend,
    ty: Option<Act16Type>,
    h: &mut Vec<f32>,
    x: &Vec<f32>,
    len: usize,
) {
    b.add(h, x, len);
    if let Some(ty) = ty {
        ty.round(&mut h[..len]);
    }
}

/// [`Backend::add_rms_norm`]: [`residual_add`] then the norm of the (rounded) sum.
#[allow(clippy::too_many_arguments)]
pub(super) fn add_rms_norm(
    b: &mut CpuBackend,
    ty: Option<Act16Type>,
    h: &mut Vec<f32>,
    x: &Vec<f32>,
    w: &Vec<f32>,
    eps: f32,
    (rows, width): (usize, usize),
    out: &mut Vec<f32>,
) {
    residual_add(b, ty, h, x, rows * width);
    b.rms_norm(h, w, eps, rows, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::test_values;
    use crate::model::{fixtures, ModelConfig};

    fn config() -> ModelConfig {
        ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap()
    }

    fn backend(ty: Option<Act16Type>) -> CpuBackend {
        let mut b = CpuBackend::new(&config());
        b.set_act16(ty);
        b
    }

    fn exact(ty: Act16Type, v: &[f32]) -> bool {
        let mut r = v.to_vec();
        ty.round(&mut r);
        r == v
    }

    /// Every residual op leaves `h` 16-bit-exact with the emulation on, and equals the f32
    /// op followed by one rounding; the norm reads the rounded sum.
    #[test]
    fn the_residual_is_rounded_after_every_add_and_the_norm_reads_it() {
        let (rows, d) = (3, 64);
        let mut vals = test_values(7);
        let (h0, x, w) = (vals(rows * d), vals(rows * d), vals(d));
        for ty in [Act16Type::Bf16, Act16Type::F16] {
            let mut on = backend(Some(ty));
            let mut off = backend(None);
            let (mut h, mut out) = (h0.clone(), vec![0.0; rows * d]);
            on.add_rms_norm(&mut h, &x, &w, 1e-5, rows, d, &mut out);
            assert!(exact(ty, &h), "{ty:?}: h not rounded");
            let (mut hf, mut of) = (h0.clone(), vec![0.0; rows * d]);
            off.add(&mut hf, &x, rows * d);
            assert_ne!(hf, h, "{ty:?}: rounding changed nothing");
            ty.round(&mut hf);
            assert_eq!(hf, h, "{ty:?}: one rounding of the f32 sum");
            off.rms_norm(&hf, &w, 1e-5, rows, &mut of);
            assert_eq!(of, out, "{ty:?}: the norm of the rounded sum");
            // The last layer's add rounds too; the gather hands the rounded rows out.
            on.residual_add(&mut h, &x, rows * d);
            assert!(exact(ty, &h), "{ty:?}: residual_add not rounded");
            let mut g = vec![0.0; d];
            on.gather_residual(&h, d, &[2], &mut g);
            assert_eq!(g, h[2 * d..]);
        }
    }

    /// Switched off, every residual op is the f32 op it replaced, bit for bit.
    #[test]
    fn off_is_the_f32_path() {
        let (rows, d) = (2, 32);
        let mut vals = test_values(11);
        let (h0, x, w) = (vals(rows * d), vals(rows * d), vals(d));
        let mut b = backend(None);
        let (mut h, mut out) = (h0.clone(), vec![0.0; rows * d]);
        b.add_rms_norm(&mut h, &x, &w, 1e-5, rows, d, &mut out);
        let (mut hf, mut of) = (h0.clone(), vec![0.0; rows * d]);
        b.add(&mut hf, &x, rows * d);
        b.rms_norm(&hf, &w, 1e-5, rows, &mut of);
        assert_eq!((h, out), (hf, of));
        assert_eq!(residual16(None), None);
        assert_eq!(residual16(Some(Act16Type::F16)), Some(Act16Type::F16));
    }

    /// The wrappers forward every residual op to the backend they wrap (the trait's defaults
    /// would run the f32 ops and skip the rounding).
    #[test]
    fn wrappers_forward_the_residual_ops() {
        use crate::backend::any::{AnyBackend, AnyBuf, AnyVector};
        use crate::backend::profiled::Profiled;
        let (rows, d) = (2, 32);
        let n = rows * d;
        let mut vals = test_values(5);
        let (h0, x, w) = (vals(n), vals(n), vals(d));
        let ty = Act16Type::Bf16;
        let mut p = Profiled::new(backend(Some(ty)));
        let (mut h, mut out) = (h0.clone(), vec![0.0; n]);
        p.add_rms_norm(&mut h, &x, &w, 1e-5, rows, d, &mut out);
        assert!(exact(ty, &h), "Profiled::add_rms_norm");
        let mut h = h0.clone();
        p.residual_add(&mut h, &x, n);
        assert!(exact(ty, &h), "Profiled::residual_add");
        let mut a = AnyBackend::Cpu(backend(Some(ty)));
        let cpu = |b: &AnyBuf| match b {
            AnyBuf::Cpu(v) => v.clone(),
            _ => panic!("a CPU buffer"),
        };
        let (mut h, xa) = (AnyBuf::Cpu(h0.clone()), AnyBuf::Cpu(x.clone()));
        a.residual_add(&mut h, &xa, n);
        assert!(exact(ty, &cpu(&h)), "AnyBackend::residual_add");
        let (mut h, mut out) = (AnyBuf::Cpu(h0.clone()), AnyBuf::Cpu(vec![0.0; n]));
        let wa = AnyVector::Cpu(w.clone());
        a.add_rms_norm(&mut h, &xa, &wa, 1e-5, rows, d, &mut out);
        assert!(exact(ty, &cpu(&h)), "AnyBackend::add_rms_norm");
        assert!(!exact(ty, &h0), "the inputs were already 16-bit-exact");
    }

    /// `embed` rounds an f32 table's rows, and leaves a 16-bit-exact table's as they are.
    #[test]
    fn embed_rounds_an_f32_table_only() {
        let c = config();
        let mut vals = test_values(3);
        let mut table = vals(c.vocab_size * c.hidden_size);
        let mut on = backend(Some(Act16Type::Bf16));
        let up = |b: &CpuBackend, t: &[f32]| {
            b.upload_linear(t.to_vec(), c.vocab_size, c.hidden_size, None)
                .unwrap()
        };
        let t = up(&on, &table);
        let ids = [1u32, 4, 2];
        let mut h = vec![0.0; ids.len() * c.hidden_size];
        on.embed(&t, &ids, &mut h);
        assert!(exact(Act16Type::Bf16, &h));
        assert_ne!(h[..c.hidden_size], table[c.hidden_size..2 * c.hidden_size]);
        Act16Type::Bf16.round(&mut table);
        let t16 = up(&on, &table);
        let mut h16 = vec![0.0; ids.len() * c.hidden_size];
        on.embed(&t16, &ids, &mut h16);
        assert_eq!(
            h16[..c.hidden_size],
            table[c.hidden_size..2 * c.hidden_size]
        );
    }
}
