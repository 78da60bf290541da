//! Ceiling of the f32 prompt GEMM's register tile on this CPU (issue 30, h30prompt): the
//! 8 × 48 tile of `x86_512_gemm::tile` (3 weight vectors and 8 activation broadcasts a step,
//! 24 FMAs) over a 144-step slice with everything in L1, against a register-only FMA loop.
//! Timed in this thread's CPU time (the VM is shared).
//!
//! `rustc -O -C target-cpu=native benches/results/f32-tile-probe.rs -o /tmp/p && /tmp/p`
use std::arch::x86_64::*;
fn tsecs() -> f64 { let mut t = std::mem::MaybeUninit::<[i64;2]>::uninit(); extern "C" { fn clock_gettime(c: i32, t: *mut [i64;2]) -> i32; }
    // SAFETY: clock 3 is CLOCK_THREAD_CPUTIME_ID, which always exists; it writes the whole timespec.
    unsafe { clock_gettime(3, t.as_mut_ptr()); let t = t.assume_init(); t[0] as f64 + t[1] as f64*1e-9 } }
#[inline(never)]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tile(a: *const f32, lda: usize, bp: *const f32, kb: usize, c: *mut f32) {
    let mut acc = [[_mm512_setzero_ps(); 3]; 8];
    for p in 0..kb {
        let b = bp.add(p * 48);
        let (b0, b1, b2) = (_mm512_loadu_ps(b), _mm512_loadu_ps(b.add(16)), _mm512_loadu_ps(b.add(32)));
        for r in 0..8 {
            let av = _mm512_set1_ps(*a.add(r * lda + p));
            acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
        }
    }
    for r in 0..8 { for v in 0..3 { _mm512_storeu_ps(c.add(r * 48 + 16 * v), acc[r][v]); } }
}
#[inline(never)]
#[target_feature(enable = "avx512f,fma")]
unsafe fn peak(iters: usize) -> f32 {
    let mut acc = [_mm512_set1_ps(0.0); 24];
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    for _ in 0..iters { for v in acc.iter_mut() { *v = _mm512_fmadd_ps(*v, a, b); } }
    let mut s = _mm512_setzero_ps(); for v in acc { s = _mm512_add_ps(s, v); } _mm512_reduce_add_ps(s)
}
fn main() {
    assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"), "needs AVX-512F and FMA");
    let kb = 144; let lda = 576;
    let a: Vec<f32> = (0..8 * lda).map(|i| i as f32 * 1e-4).collect();
    let b: Vec<f32> = (0..kb * 48).map(|i| i as f32 * 1e-4).collect();
    let mut c = vec![0f32; 8 * 48];
    let mut best = f64::MAX; let it = 2000;
    for _ in 0..20 { let t = tsecs(); for _ in 0..it {
        // SAFETY: the features were checked above; a holds 8 rows of lda ≥ kb, b kb × 48, c 8 × 48.
        unsafe { tile(a.as_ptr(), lda, b.as_ptr(), kb, c.as_mut_ptr()) }; std::hint::black_box(&mut c); } best = best.min(tsecs() - t); }
    let fl = (it * kb * 8 * 48 * 2) as f64;
    println!("tile: {:.1} GFLOP/s", fl / best / 1e9);
    let mut best = f64::MAX; let it = 1_000_000;
    // SAFETY: the features were checked above; peak touches registers only.
    for _ in 0..10 { let t = tsecs(); std::hint::black_box(unsafe { peak(it) }); best = best.min(tsecs() - t); }
    println!("peak: {:.1} GFLOP/s", (it * 24 * 32) as f64 / best / 1e9);
}
