//! The loader threads: disk → host. Each parses and validates a PEFT adapter from its
//! safetensors file off the engine's thread; several run at once (the loads are taken first
//! in, first out and reported as each finishes), so a read slower than the gap between
//! arrivals does not make every later read wait behind it.
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{unbounded, Receiver, Sender};
use thaw_runtime::adapter::{AdapterError, LoraAdapter};
use thaw_runtime::model::ModelConfig;

/// A finished load: the caller's key and the adapter or why it failed.
pub type Loaded = (usize, Result<Arc<LoraAdapter>, AdapterError>);

/// Background loader threads; dropping it finishes queued loads and joins the threads.
pub struct Loader {
    tx: Option<Sender<(usize, PathBuf)>>,
    rx: Receiver<Loaded>,
    threads: Vec<JoinHandle<()>>,
}

impl Loader {
    /// Starts `threads` loader threads (at least one; the server's default is
    /// [`crate::memory::loader::default_threads`]).
    pub fn spawn(model: ModelConfig, threads: usize) -> Self {
        let (tx, jobs) = unbounded::<(usize, PathBuf)>();
        let (done_tx, rx) = unbounded();
        let model = Arc::new(model);
        let threads = (0..threads.max(1))
            .map(|i| {
                let (jobs, done_tx, model) = (jobs.clone(), done_tx.clone(), model.clone());
                std::thread::Builder::new()
                    .name(format!("thaw-loader-{i}"))
                    .spawn(move || {
                        thaw_cpu_lora::float_current_thread();
                        for (key, dir) in jobs {
                            let r = LoraAdapter::load(&dir, &model).map(Arc::new);
                            if done_tx.send((key, r)).is_err() {
                                break;
                            }
                        }
                    })
                    .expect("spawning a loader thread")
            })
            .collect();
        Self {
            tx: Some(tx),
            rx,
            threads,
        }
    }

    /// A handle that queues loads, from any thread. Drop every requester before the
    /// [`Loader`]: dropping the loader waits for its threads, which run while one is alive.
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
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora_open::tests::{copy_adapter, fixture};

    /// Every queued load is reported once, under its key, whichever thread read it; a
    /// missing directory fails alone.
    #[test]
    fn every_load_is_reported_once_by_any_thread() {
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let good = tmp.path().join("a");
        copy_adapter(&good);
        let loader = Loader::spawn(model, 3);
        let req = loader.requester();
        for k in 0..7 {
            let dir = if k == 4 {
                tmp.path().join("missing")
            } else {
                good.clone()
            };
            req.request(k, dir);
        }
        drop(req);
        let mut seen = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while seen.len() < 7 && std::time::Instant::now() < deadline {
            for (k, r) in loader.finished() {
                assert_eq!(r.is_err(), k == 4, "load {k}: {:?}", r.err());
                seen.push(k);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        seen.sort();
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
    }
}
