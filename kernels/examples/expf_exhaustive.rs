//! Checks `thaw_kernels::cpu::expf` against this machine's libm (`f32::exp`) and its
//! 16-lane form (`expf_slice`) against the port, over all 2³² f32 bit patterns, and times the
//! three over a softmax-like range.
//!
//! `cargo run --release -p thaw-kernels --example expf_exhaustive [STRIDE]` (STRIDE 1 = every
//! input; a larger stride samples every STRIDE-th bit pattern).
use std::time::Instant;

use thaw_kernels::cpu::{expf, expf_slice};

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn main() {
    let stride: u64 = std::env::args()
        .nth(1)
        .map_or(1, |s| s.parse().expect("STRIDE: a positive integer"));
    let (mut libm_diff, mut vec_diff, mut n) = (0u64, 0u64, 0u64);
    let chunk = 1 << 16;
    let mut xs = Vec::with_capacity(chunk);
    let mut out = vec![0.0f32; chunk];
    let mut b: u64 = 0;
    while b < 1 << 32 {
        xs.clear();
        while xs.len() < chunk && b < 1 << 32 {
            xs.push(f32::from_bits(b as u32));
            b += stride;
        }
        expf_slice(&xs, &mut out[..xs.len()]);
        for (&x, &v) in xs.iter().zip(&out) {
            let p = expf(x);
            if !same(p, x.exp()) {
                if libm_diff < 10 {
                    println!(
                        "libm differs: x = {x:e} ({:#x}): port {p:e}, libm {:e}",
                        x.to_bits(),
                        x.exp()
                    );
                }
                libm_diff += 1;
            }
            if !same(p, v) {
                if vec_diff < 10 {
                    println!(
                        "vector differs: x = {x:e} ({:#x}): port {p:e}, vector {v:e}",
                        x.to_bits()
                    );
                }
                vec_diff += 1;
            }
        }
        n += xs.len() as u64;
    }
    println!(
        "{n} inputs: {libm_diff} differ from libm, {vec_diff} vector lanes differ from the port"
    );

    let xs: Vec<f32> = (0..1 << 16).map(|i| -(i as f32) / 4096.0).collect();
    let mut out = vec![0.0f32; xs.len()];
    let reps = 200;
    let t = Instant::now();
    for _ in 0..reps {
        for (o, &x) in out.iter_mut().zip(&xs) {
            *o = std::hint::black_box(x).exp();
        }
    }
    let libm = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..reps {
        for (o, &x) in out.iter_mut().zip(&xs) {
            *o = expf(std::hint::black_box(x));
        }
    }
    let port = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..reps {
        expf_slice(std::hint::black_box(&xs), &mut out);
    }
    let vector = t.elapsed().as_secs_f64();
    let per = |s: f64| s * 1e9 / (reps * xs.len()) as f64;
    println!(
        "ns per value: libm {:.2}, port {:.2}, 16-lane {:.2}",
        per(libm),
        per(port),
        per(vector)
    );
}
