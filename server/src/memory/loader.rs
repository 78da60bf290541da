//! The disk → host loader: one thread that reads and validates adapters the memory manager
//! asks for, off the engine thread, and hands each result to a callback (the engine loop sends
//! it back to itself as a command).
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
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

/// The loader thread; dropping it stops the thread after the job in hand.
pub struct Loader {
    tx: Option<mpsc::Sender<FetchJob>>,
    thread: Option<JoinHandle<()>>,
}

impl Loader {
    pub fn start(
        model: ModelConfig,
        done: impl Fn(AdapterId, FetchResult) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<FetchJob>();
        let thread = std::thread::Builder::new()
            .name("thaw-loader".into())
            .spawn(move || {
                for job in rx {
                    done(job.id, read(&job, &model));
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
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
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
