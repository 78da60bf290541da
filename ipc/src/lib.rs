//! Shared-memory segments, typed layouts and doorbells between the Thaw engine and its
//! pinned CPU LoRA worker processes.
//!
//! **Owns:**
//! - [`Segment`]: an anonymous, size-sealed memfd mapped shared, with a `#[repr(C)]` header
//!   (magic, version, kind, size, config) validated on open. Handed to workers by fd
//!   inheritance ([`Segment::inherit_into`] / [`Segment::from_inherited_env`]); nothing is
//!   ever created in `/dev/shm`, so nothing is left behind when a process dies.
//! - [`Exchange`] / [`WorkerPort`]: the per-step exchange — job table, input rows, Δ rows,
//!   the step sequence word with its doorbell (armed word, futex bell), per-worker result,
//!   heartbeat and pid words. Waiting is [`WaitStrategy::Spin`] or
//!   [`WaitStrategy::SpinThenFutex`] behind one interface.
//! - [`HostStore`] / [`StoreReader`]: the host adapter store — an arena of adapter weights in
//!   their stored dtype with an index keyed by (id, generation), written by one process and
//!   read zero-copy under leases by any process. A *file entry*
//!   ([`HostStore::insert_file`]) holds no weights but the adapter's safetensors file
//!   (path, length, identity) and each (layer, module)'s offsets in it, validated against the
//!   file's length: the disk tier, which readers map themselves (this crate opens no file).
//!
//! **Does not touch:** CUDA (the runtime registers [`Segment::base_addr`] as pinned memory
//! and finds words through [`ExchangeLayout`]), LoRA math (`thaw-cpu-lora`), process
//! spawning or pinning policy, disk formats, or scheduling. Layouts hold offsets, never
//! pointers.
//!
//! All `unsafe` primitives (mmap, futex, atomics and slices into the mapping, fd adoption)
//! live in the private `sys` module; the few callers of its slice accessors state the
//! protocol invariant that makes each access race-free.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use thaw_ipc::*;
//!
//! let cfg = ExchangeConfig { max_workers: 1, max_rows: 4, max_d_in: 8, max_d_out: 8, ..Default::default() };
//! let mut engine = Exchange::create(cfg)?;
//! let theirs = Exchange::open(Segment::open_fd(engine.segment().try_clone_fd()?, SegmentKind::Exchange)?)?;
//! let mut worker = WorkerPort::attach(theirs, WorkerId(0))?;
//!
//! engine.set_jobs(&[])?;
//! engine.post_step(StepSeq(1))?;
//! assert_eq!(worker.wait_step(WaitStrategy::spin(), None), WaitOutcome::Step(StepSeq(1)));
//! worker.complete();
//! let deadline = Instant::now() + Duration::from_secs(1);
//! engine.wait_results(StepSeq(1), WorkerMask::first(1), WaitStrategy::spin(), deadline).unwrap();
//! # Ok::<(), IpcError>(())
//! ```

mod alloc;
mod doorbell;
mod error;
mod exchange;
mod segment;
mod store;
mod store_fill;
mod store_writer;
mod sys;
mod types;
mod worker;

pub use doorbell::WaitStrategy;
pub use error::{IpcError, Result};
pub use exchange::{
    Exchange, ExchangeConfig, ExchangeLayout, Job, WorkerStatus, WORKER_HEARTBEAT, WORKER_PID,
    WORKER_RESULT,
};
pub use segment::{
    Segment, SegmentHeader, SegmentKind, CONFIG_WORDS, HEADER_LEN, LAYOUT_VERSION, MAGIC,
};
pub use store::{AdapterLease, LoraView, LoraWeights, StoreConfig, StoreReader};
pub use store_fill::StoreFill;
pub use store_writer::{FileSource, FileTensors, HostStore, LayerModuleWeights, ModuleShape};
pub use sys::thread_cpu_time;
pub use types::{
    AdapterHandle, AdapterId, DType, Generation, LayerIdx, Module, ModuleMask, ReaderSlot, StepSeq,
    WorkerId, WorkerMask, NUM_MODULES,
};
pub use worker::{WaitOutcome, WorkerPort};
