//! The loader thread: disk → host tier. Parses and validates a PEFT adapter from its
//! memory-mapped safetensors file (dtype conversion included) off the engine's thread.
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{unbounded, Receiver, Sender};
use thaw_runtime::adapter::{AdapterError, LoraAdapter};
use thaw_runtime::model::ModelConfig;

/// A finished load: the caller's key and the adapter or why it failed.
pub type Loaded = (usize, Result<Arc<LoraAdapter>, AdapterError>);

/// A background loader; dropping it finishes queued loads and joins the thread.
pub struct Loader {
    tx: Option<Sender<(usize, PathBuf)>>,
    rx: Receiver<Loaded>,
    thread: Option<JoinHandle<()>>,
}

impl Loader {
    pub fn spawn(model: ModelConfig) -> Self {
        let (tx, jobs) = unbounded::<(usize, PathBuf)>();
        let (done_tx, rx) = unbounded();
        let thread = std::thread::Builder::new()
            .name("thaw-loader".into())
            .spawn(move || {
                thaw_cpu_lora::float_current_thread();
                for (key, dir) in jobs {
                    let r = LoraAdapter::load(&dir, &model).map(Arc::new);
                    if done_tx.send((key, r)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the loader thread");
        Self {
            tx: Some(tx),
            rx,
            thread: Some(thread),
        }
    }

    /// A handle that queues loads, from any thread. Drop every requester before the
    /// [`Loader`]: dropping the loader waits for its thread, which runs while one is alive.
    pub fn requester(&self) -> LoadRequester {
        LoadRequester(self.tx.clone())
    }

    /// Loads finished since the last call.
    pub fn finished(&self) -> impl Iterator<Item = Loaded> + '_ {
        self.rx.try_iter()
    }
}

/// Queues loads on a [`Loader`] from another thread.
#[derive(Clone)]
pub struct LoadRequester(Option<Sender<(usize, PathBuf)>>);

impl LoadRequester {
    /// Queues the adapter in `dir` under `key`; a no-op once the loader is gone.
    pub fn request(&self, key: usize, dir: PathBuf) {
        if let Some(tx) = &self.0 {
            let _ = tx.send((key, dir));
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
