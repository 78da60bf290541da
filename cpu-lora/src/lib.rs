//! Pinned CPU worker processes computing LoRA deltas from shared memory.
//!
//! This crate owns the CPU side of CPU-assisted LoRA (DESIGN.md §4, CaraServe §4): worker
//! processes pinned one per core wait on a step's doorbell, read activations and adapter
//! weights in place from shared memory, compute `Δ = scale · (x · Aᵀ) · Bᵀ` for their slice of
//! rows and publish it. It does not own the exchange segment's layout (`thaw-ipc`), the host
//! adapter store, or the decision of when to assist (the runtime's cost model).
//!
//! - [`kernel`]: the compute kernel, a fused shrink + expand blocked for cache, AVX-512 /
//!   AVX2+FMA+F16C with run-time dispatch and a portable fallback, reading f32, f16 or bf16
//!   weights in their stored format (the CPU backend uses it for its own LoRA too).
//! - [`worker`]: the `thaw lora-worker` process — pinned to one core, it maps the exchange and
//!   the host store from inherited memfds, waits on its doorbell, computes its rows, publishes
//!   Δ and heartbeats.
//! - [`pool`]: the engine side — spawns the workers, profiles them (rows/ms per shape, refreshed
//!   online), splits each step's rows in proportion, detects dead or stuck workers, recomputes
//!   their rows so the step still completes correctly, and respawns them.
//!
//! ```
//! use thaw_cpu_lora::kernel::{lora_delta, LoraMat, LoraProblem, Scratch};
//!
//! let p = LoraProblem { rows: 2, d_in: 3, d_out: 2, rank: 1, scale: 0.5 };
//! let x = [1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
//! let a = [1.0f32, 1.0, 1.0]; // [rank, d_in]
//! let b = [2.0f32, -2.0]; //     [d_out, rank]
//! let mut out = [0.0; 4];
//! let mut scratch = Scratch::new();
//! lora_delta(&p, &x, LoraMat::from_f32(&a), LoraMat::from_f32(&b), &mut out, false, &mut scratch)?;
//! assert_eq!(out, [6.0, -6.0, 0.0, 0.0]);
//! # Ok::<(), thaw_cpu_lora::kernel::LoraError>(())
//! ```

pub mod kernel;

mod calibrate;
mod compute;
mod error;
mod procs;
mod sys;

pub mod file_maps;
pub mod pool;
pub mod profile;
pub mod stats;
pub mod worker;

pub use calibrate::CalibrationShape;
pub use compute::{weight_dtype, ComputeState};
pub use error::CpuLoraError;
pub use pool::{Assignment, DeviceStep, LoraJob, LoraPool, PoolConfig, StepReport, Ticket};
pub use procs::{SlotState, WorkerInfo};
pub use profile::{split_rows, Profile, ShapeKey};
pub use stats::WorkerStepStat;
pub use worker::{float_current_thread, worker_main, WaitMode, WorkerArgs};
