//! Ceiling of the VNNI prompt tile's arithmetic on this CPU (issue 30, h30prompt): a 4-row ×
//! 48-column register tile of `vpdpbusd` (8 per 32-value block and output vector) alone
//! (mode 0), with the Q8_0 block epilogue (convert, multiply by the activation scale, fused
//! add with the weight scale: mode 1; the sums started from a register copy instead of zero:
//! mode 3) and with the Q4_1/Q4_K minimum term too (mode 2); all operands in registers or L1.
//! Timed in this thread's CPU time (the VM is shared).
//!
//! `rustc -O -C target-cpu=native benches/results/vnni-epilogue-probe.rs -o /tmp/p && /tmp/p`
use std::arch::x86_64::*;
fn tsecs() -> f64 { let mut t = std::mem::MaybeUninit::<[i64;2]>::uninit(); extern "C" { fn clock_gettime(c: i32, t: *mut [i64;2]) -> i32; }
    // SAFETY: clock 3 is CLOCK_THREAD_CPUTIME_ID, which always exists; it writes the whole timespec.
    unsafe { clock_gettime(3, t.as_mut_ptr()); let t = t.assume_init(); t[0] as f64 + t[1] as f64*1e-9 } }
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
unsafe fn k(iters: usize, mode: u32, sc: &[f32; 48]) -> f32 {
    let mut isum = [[_mm512_setzero_si512(); 3]; 4];
    let mut acc = [[_mm512_setzero_ps(); 3]; 4];
    let w = [_mm512_set1_epi8(3), _mm512_set1_epi8(-2), _mm512_set1_epi8(5)];
    let xs: [i32; 32] = std::array::from_fn(|i| i as i32 * 0x01010101);
    for it in 0..iters {
        let st = [_mm512_loadu_si512(sc.as_ptr().cast()), _mm512_loadu_si512(sc.as_ptr().add(16).cast()), _mm512_loadu_si512(sc.as_ptr().add(32).cast())];
        for r in 0..4 { for v in 0..3 { isum[r][v] = if mode == 0 { isum[r][v] } else if mode == 3 { st[v] } else { _mm512_setzero_si512() }; } }
        for e in 0..8 {
            for r in 0..4 {
                let a = _mm512_set1_epi32(*xs.as_ptr().add((e * 4 + r + it) & 31));
                for v in 0..3 { isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], a, w[v]); }
            }
        }
        if mode >= 1 {
            for r in 0..4 {
                let dx = _mm512_set1_ps(sc[(r + it) & 31]);
                for v in 0..3 {
                    let p = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][v]), dx);
                    acc[r][v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(sc.as_ptr().add(16 * v)), acc[r][v]);
                    if mode == 2 {
                        acc[r][v] = _mm512_fnmadd_ps(_mm512_loadu_ps(sc.as_ptr().add(16 * v + 1)), _mm512_set1_ps(sc[(r + it + 3) & 31]), acc[r][v]);
                    }
                }
            }
        }
    }
    let mut s = _mm512_setzero_ps();
    for r in 0..4 { for v in 0..3 { s = _mm512_add_ps(s, _mm512_add_ps(acc[r][v], _mm512_cvtepi32_ps(isum[r][v]))); } }
    _mm512_reduce_add_ps(s)
}
fn main() {
    assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("fma"), "needs AVX-512 VNNI");
    let sc: [f32; 48] = std::array::from_fn(|i| 1.0 + i as f32 * 1e-3);
    for mode in [0u32, 1, 3, 2] {
        let iters = 200_000;
        let mut best = f64::MAX;
        // SAFETY: the features were checked above; k touches registers and sc only.
        for _ in 0..20 { let t = tsecs(); std::hint::black_box(unsafe { k(iters, mode, std::hint::black_box(&sc)) }); best = best.min(tsecs() - t); }
        let dp = iters as f64 * 96.0;
        println!("mode {mode}: {:.2} GMAC/s ({:.3} ns per dpbusd) ", dp * 64.0 / best / 1e9, best / dp * 1e9);
    }
}
