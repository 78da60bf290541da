//! The disk → host loader: a few threads that read and validate adapters the memory manager
//! asks for, off the engine thread, and hand each result to a callback (the engine loop sends
//! it back to itself as a command). Several threads, because with many adapters in use every
//! request may need a read, and one thread reading them one after another was what requests
//! waited on.
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::ids::AdapterId;
use thaw_runtime::model::ModelConfig;

/// One read to do.
#[derive(Clone, Debug)]
pub struct FetchJob {
    pub id: AdapterId,
    pub path: PathBuf,
    /// What the adapter weighed when it was registered; a different file is an error.
    pub bytes: u64,
}

/// A finished read: the host copy and the seconds it took, or what went wrong (safe to show).
pub type FetchResult = Result<(Arc<LoraAdapter>, f64), String>;

/// The loader threads; dropping it stops them after the jobs in hand.
pub struct Loader {
    tx: Option<crossbeam::channel::Sender<FetchJob>>,
    threads: Vec<JoinHandle<()>>,
}

/// Loader threads: the cores beside the engine's, at least one, at most four.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .clamp(1, 4)
}

impl Loader {
    /// Starts `threads` (at least one) reader threads.
    pub fn start(
        model: ModelConfig,
        threads: usize,
        done: impl Fn(AdapterId, FetchResult) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam::channel::unbounded::<FetchJob>();
        let done = Arc::new(done);
        let model = Arc::new(model);
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (rx, done, model) = (rx.clone(), done.clone(), model.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("thaw-loader-{i}"))
                .spawn(move || {
                    for job in rx {
                        done(job.id, read(&job, &model));
                    }
                });
            match spawned {
                Ok(h) => handles.push(h),
                // Keep the threads already running; none at all is an error.
                Err(e) if handles.is_empty() => return Err(e),
                Err(e) => tracing::warn!("starting adapter loader thread {i}: {e}"),
            }
        }
        Ok(Self {
            tx: Some(tx),
            threads: handles,
        })
    }

    /// Queues a read; false if the thread is gone.
    pub fn fetch(&self, job: FetchJob) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }
}

fn read(job: &FetchJob, model: &ModelConfig) -> FetchResult {
    let start = Instant::now();
    let a = LoraAdapter::load(&job.path, model).map_err(|e| {
        format!(
            "reading adapter files at {} failed: {e}; fix them and load the adapter again",
            job.path.display()
        )
    })?;
    if a.size_bytes_f32() as u64 != job.bytes {
        return Err(format!(
            "the adapter at {} changed on disk since it was loaded ({} bytes, now {}); load it \
             again under its name",
            job.path.display(),
            job.bytes,
            a.size_bytes_f32()
        ));
    }
    Ok((Arc::new(a), start.elapsed().as_secs_f64()))
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
