//! The UNIX-domain-socket baseline of `thaw-bench lora-ipc` (CaraServe Fig. 17's "Socket"):
//! a worker process that receives `x` serialised over a socket, computes Δ for q and v with
//! the same kernel as the shared-memory workers, and sends Δ back with the compute time it
//! measured.
//!
//! Message engine → worker: `rows u32` then `rows · hidden` f32 (little-endian).
//! Reply: `compute_ns u64` then Δq and Δv, `rows · hidden` f32 each. `rows = 0` ends.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use thaw_cpu_lora::kernel::{lora_delta, LoraMat, LoraProblem, Scratch};

/// Arguments of the hidden `lora-socket-worker` subcommand.
#[derive(clap::Args, Clone, Debug)]
pub struct SocketWorkerArgs {
    /// Socket to connect to.
    #[arg(long)]
    pub socket: PathBuf,
    /// Hidden size.
    #[arg(long)]
    pub hidden: usize,
    /// LoRA rank.
    #[arg(long)]
    pub rank: usize,
    /// Seed of the adapter weights (the same as the engine's).
    #[arg(long)]
    pub seed: u64,
    /// Core to pin to.
    #[arg(long)]
    pub core: Option<usize>,
}

/// Deterministic weights of `modules` square modules (A `[rank, hidden]`, B
/// `[hidden, rank]` each), shared by the engine (host store) and the socket workers.
pub fn adapter_weights(
    hidden: usize,
    rank: usize,
    seed: u64,
    modules: usize,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut mat = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-0.5..0.5)).collect() };
    (0..modules)
        .map(|_| (mat(rank * hidden), mat(hidden * rank)))
        .collect()
}

/// The LoRA scale used by the benchmarks.
pub const SCALE: f32 = 0.5;

/// Runs the socket worker until the engine sends `rows = 0` or hangs up.
pub fn run_worker(args: &SocketWorkerArgs) -> anyhow::Result<()> {
    if let Some(core) = args.core {
        core_affinity::set_for_current(core_affinity::CoreId { id: core });
    }
    let (h, r) = (args.hidden, args.rank);
    let w = adapter_weights(h, r, args.seed, 2);
    let mut sock = UnixStream::connect(&args.socket)?;
    let mut scratch = Scratch::new();
    let mut inbuf: Vec<u8> = Vec::new();
    let mut x: Vec<f32> = Vec::new();
    let mut delta: Vec<f32> = Vec::new();
    let mut outbuf: Vec<u8> = Vec::new();
    loop {
        let mut head = [0u8; 4];
        if sock.read_exact(&mut head).is_err() {
            return Ok(());
        }
        let rows = u32::from_le_bytes(head) as usize;
        if rows == 0 {
            return Ok(());
        }
        // Deserialise x.
        inbuf.resize(rows * h * 4, 0);
        sock.read_exact(&mut inbuf)?;
        x.clear();
        x.extend(
            inbuf
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        let t = Instant::now();
        delta.resize(2 * rows * h, 0.0);
        let p = LoraProblem {
            rows,
            d_in: h,
            d_out: h,
            rank: r,
            scale: SCALE,
        };
        for (m, (a, b)) in w.iter().enumerate() {
            let out = &mut delta[m * rows * h..(m + 1) * rows * h];
            lora_delta(
                &p,
                &x,
                LoraMat::from_f32(a),
                LoraMat::from_f32(b),
                out,
                false,
                &mut scratch,
            )?;
        }
        let ns = t.elapsed().as_nanos() as u64;
        // Serialise the reply.
        outbuf.clear();
        outbuf.extend_from_slice(&ns.to_le_bytes());
        for v in &delta {
            outbuf.extend_from_slice(&v.to_le_bytes());
        }
        sock.write_all(&outbuf)?;
    }
}
