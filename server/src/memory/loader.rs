//! The disk → host loader: a few threads that read and validate adapters off the engine
//! thread, and hand each result to a callback (the engine loop sends it back to itself as a
//! command; the cold-start driver to a channel it polls). Several threads, taking the reads
//! first in, first out and reporting each as it finishes, because with many adapters in use
//! every request may need a read, and one thread reading them one after another was what
//! requests waited on. The one loader of the server and of the cold-start driver.
//!
//! A read keeps the adapter in place where the backend reads its stored dtype: the file is
//! mapped and every weight checked where it lies ([`LoraAdapter::load_in_place`]), so its
//! bytes are in host memory once (the page cache's pages, which the upload pipeline encodes
//! into the arena and the CPU LoRA paths read) instead of again in a heap copy. An adapter the
//! backend must convert is read into memory and converted here, once.
//!
//! An adapter loaded at run time under `--lora-root` is re-read through the same confinement
//! as its first load ([`crate::lora_open::load_confined`]): a directory swapped for a link
//! out of the root after the load is refused, and the requests waiting for it fail with that
//! reason.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use thaw_runtime::adapter::{AdapterError, LoraAdapter, WeightDtype};
use thaw_runtime::ids::AdapterId;
use thaw_runtime::model::ModelConfig;

use crate::lora_open::{load_host_confined, relative, OpenError};

/// One read to do.
#[derive(Clone, Debug)]
pub struct FetchJob {
    pub id: AdapterId,
    pub path: PathBuf,
    /// The `--lora-root` its reads are confined to (runtime loads under a root).
    pub root: Option<PathBuf>,
    /// What the adapter weighed when it was registered; a different file is an error. `None`:
    /// a first read, nothing to compare with (the cold-start driver's disk-tier adapters); it
    /// counts as no bytes in the read queue.
    pub bytes: Option<u64>,
}

/// A finished read: the host copy and the seconds it took, or what went wrong (safe to show).
pub type FetchResult = Result<(Arc<LoraAdapter>, f64), String>;

/// The loader threads; dropping it stops them after the jobs in hand.
pub struct Loader {
    tx: Option<crossbeam::channel::Sender<FetchJob>>,
    threads: Vec<JoinHandle<()>>,
    queue: Arc<Mutex<ReadQueue>>,
}

/// The reads queued or in flight, in the order they were queued (the threads take them first
/// in, first out).
#[derive(Default)]
struct ReadQueue {
    /// Reads queued so far: the next one's place.
    next: u64,
    /// Reads not finished: each one's place and bytes.
    open: HashMap<AdapterId, (u64, u64)>,
}

impl ReadQueue {
    fn push(&mut self, id: AdapterId, bytes: u64) {
        self.open.insert(id, (self.next, bytes));
        self.next += 1;
    }

    fn pop(&mut self, id: AdapterId) {
        self.open.remove(&id);
    }

    /// Bytes of the reads queued before `id`'s and not finished (reads in flight count whole).
    fn ahead(&self, id: AdapterId) -> Option<u64> {
        let (place, _) = *self.open.get(&id)?;
        Some(
            self.open
                .values()
                .filter(|(p, _)| *p < place)
                .map(|(_, b)| b)
                .sum(),
        )
    }
}

/// Loader threads: the cores beside the engine's, at least one, at most four.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .clamp(1, 4)
}

impl Loader {
    /// Starts `threads` (at least one) reader threads. `dtype`: the one dtype the backend
    /// computes adapters in, if it reads only one; each read converts to it on its loader
    /// thread (see `LoraAdapter::into_dtype`), never on the engine thread.
    pub fn start(
        model: ModelConfig,
        threads: usize,
        dtype: Option<WeightDtype>,
        done: impl Fn(AdapterId, FetchResult) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam::channel::unbounded::<FetchJob>();
        let done = Arc::new(done);
        let model = Arc::new(model);
        let queue = Arc::new(Mutex::new(ReadQueue::default()));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (rx, done, model) = (rx.clone(), done.clone(), model.clone());
            let queue = queue.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("thaw-loader-{i}"))
                .spawn(move || {
                    // Off the (possibly pinned) engine thread's core, below its priority.
                    thaw_cpu_lora::float_current_thread();
                    thaw_runtime::upload::lower_current_thread_priority();
                    for job in rx {
                        let r = read(&job, &model, dtype);
                        queue.lock().unwrap_or_else(|e| e.into_inner()).pop(job.id);
                        done(job.id, r);
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
            queue,
        })
    }

    /// Queues a read; false if the thread is gone.
    pub fn fetch(&self, job: FetchJob) -> bool {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.push(job.id, job.bytes.unwrap_or(0));
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(job.clone()).is_ok());
        if !sent {
            q.pop(job.id);
        }
        sent
    }

    /// The reads ahead of `id`'s (queued before it, not finished) and the threads sharing
    /// them, for the cold-start model; `None` once its read is done or if it was never queued.
    pub fn reads_ahead(&self, id: AdapterId) -> Option<crate::perf::DiskQueue> {
        let ahead = self
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ahead(id)?;
        Some(crate::perf::DiskQueue {
            ahead_bytes: ahead,
            readers: self.threads.len(),
        })
    }
}

/// Reads `job`'s adapter as the backend computes it (`dtype`): confined to its root if it has
/// one, in place where it keeps the stored dtype ([`LoraAdapter::load_host`]). Errors name
/// paths under a root as `<lora-root>/…`.
fn read_adapter(
    job: &FetchJob,
    model: &ModelConfig,
    dtype: Option<WeightDtype>,
) -> Result<LoraAdapter, String> {
    let shown = |p: &Path| shown(job, p);
    let failed = |e: AdapterError| {
        format!(
            "reading adapter files at {} failed: {e}; fix them and load the adapter again",
            shown(&job.path).display()
        )
    };
    let Some(root) = &job.root else {
        return LoraAdapter::load_host(&job.path, model, dtype).map_err(failed);
    };
    load_host_confined(root, &job.path, model, dtype).map_err(|e| match e {
        OpenError::Outside => format!(
            "the files of adapter {} are no longer inside the server's --lora-root (a link \
             out of the root was put in their place since the adapter was loaded); restore \
             the directory and load the adapter again",
            shown(&job.path).display()
        ),
        OpenError::Adapter(e) => failed(relative(root, e)),
    })
}

/// `p` as a client may see it: relative to the job's root, if any.
fn shown(job: &FetchJob, p: &Path) -> PathBuf {
    match &job.root {
        Some(root) => match p.strip_prefix(root) {
            Ok(r) => Path::new("<lora-root>").join(r),
            Err(_) => p.to_path_buf(),
        },
        None => p.to_path_buf(),
    }
}

fn read(job: &FetchJob, model: &ModelConfig, dtype: Option<WeightDtype>) -> FetchResult {
    let start = Instant::now();
    let a = read_adapter(job, model, dtype)?;
    if let Some(bytes) = job.bytes.filter(|&b| b != a.size_bytes() as u64) {
        return Err(format!(
            "the adapter at {} changed on disk since it was loaded ({bytes} bytes, now {}); \
             load it again under its name",
            shown(job, &job.path).display(),
            a.size_bytes()
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Reads finish in any order: what is ahead of an open read is the bytes of the reads
        /// queued before it and not finished, 0 once all of those are done; a finished read
        /// has nothing ahead.
        #[test]
        fn reads_ahead_count_the_unfinished_reads_queued_before(
            sizes in prop::collection::vec(1u64..1000, 1..12),
            order in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        ) {
            let mut q = ReadQueue::default();
            for (i, &b) in sizes.iter().enumerate() {
                q.push(AdapterId(i as u32), b);
            }
            let mut done = vec![false; sizes.len()];
            for ix in order {
                let i = ix.index(sizes.len());
                q.pop(AdapterId(i as u32));
                done[i] = true;
                for j in (0..sizes.len()).filter(|&j| !done[j]) {
                    let open_before: u64 = (0..j).filter(|&k| !done[k]).map(|k| sizes[k]).sum();
                    prop_assert_eq!(q.ahead(AdapterId(j as u32)), Some(open_before));
                }
                prop_assert_eq!(q.ahead(AdapterId(i as u32)), None);
            }
        }
    }
    use crate::lora_open::tests::{copy_adapter, fixture};

    /// A re-read under a root goes through the confinement: fine while the directory is
    /// untouched, refused (naming no absolute path) once it is swapped for a link out of the
    /// root — though the same job without a root reads the linked copy happily.
    #[test]
    fn confined_rereads_refuse_a_directory_swapped_for_a_link() {
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        copy_adapter(&root.join("a"));
        copy_adapter(&outside);
        let root = std::fs::canonicalize(root).unwrap();
        let bytes = LoraAdapter::load(&root.join("a"), &model)
            .unwrap()
            .size_bytes() as u64;
        let job = FetchJob {
            id: AdapterId(7),
            path: root.join("a"),
            root: Some(root.clone()),
            bytes: Some(bytes),
        };
        let (a, _) = read(&job, &model, None).unwrap();
        assert_eq!(a.size_bytes() as u64, bytes);
        // A first read (no size known) reads whatever is there.
        let first = FetchJob {
            bytes: None,
            ..job.clone()
        };
        assert_eq!(
            read(&first, &model, None).unwrap().0.size_bytes() as u64,
            bytes
        );

        let wrong = FetchJob {
            bytes: Some(bytes + 1),
            ..job.clone()
        };
        let e = read(&wrong, &model, None).unwrap_err();
        assert!(
            e.contains("changed on disk") && e.contains("<lora-root>/a"),
            "{e}"
        );

        std::fs::rename(root.join("a"), tmp.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("a")).unwrap();
        let e = read(&job, &model, None).unwrap_err();
        assert!(
            e.contains("no longer inside the server's --lora-root"),
            "{e}"
        );
        assert!(e.contains("<lora-root>/a"), "{e}");
        assert!(!e.contains(tmp.path().to_str().unwrap()), "{e}");
        let unconfined = FetchJob { root: None, ..job };
        assert!(read(&unconfined, &model, None).is_ok());

        // A file missing at re-read time: named relative to the root.
        std::fs::remove_file(root.join("a")).unwrap();
        copy_adapter(&root.join("a"));
        std::fs::remove_file(root.join("a/adapter_model.safetensors")).unwrap();
        let job = FetchJob {
            root: Some(root.clone()),
            ..unconfined
        };
        let e = read(&job, &model, None).unwrap_err();
        assert!(e.contains("<lora-root>/a/adapter_model.safetensors"), "{e}");
        assert!(!e.contains(tmp.path().to_str().unwrap()), "{e}");
    }

    /// A read keeps the adapter in place where the backend reads its stored dtype: its
    /// factors are the file's pages (no heap copy), verified, the same bytes a read into memory
    /// gives; where the backend reads another dtype it is read into memory and converted. A
    /// NaN in the file fails the read in place with the message of a read into memory, under
    /// a root named relative to it.
    #[test]
    fn reads_keep_the_stored_dtype_in_place() {
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        copy_adapter(&root.join("a"));
        let owned = LoraAdapter::load(&root.join("a"), &model).unwrap();
        let stored = owned.dtype();
        for under in [None, Some(root.clone())] {
            let job = FetchJob {
                id: AdapterId(1),
                path: root.join("a"),
                root: under,
                bytes: Some(owned.size_bytes() as u64),
            };
            for want in [None, Some(stored)] {
                let (a, _) = read(&job, &model, want).unwrap();
                assert!(a.is_mapped() && a.is_verified() && a.file_source().is_some());
                for ((l, m, w), (_, _, w2)) in a.iter().zip(owned.iter()) {
                    assert_eq!(w, w2, "layer {l} {m}");
                }
            }
            let other = [WeightDtype::F32, WeightDtype::Bf16]
                .into_iter()
                .find(|&d| d != stored)
                .unwrap();
            // Converted, it weighs what the converted copy weighs: no size to compare here.
            let first = FetchJob {
                bytes: None,
                ..job.clone()
            };
            let (a, _) = read(&first, &model, Some(other)).unwrap();
            assert!(!a.is_mapped() && a.stored_as(Some(other)));
        }

        // A NaN as the first element of the first factor, in the file's dtype.
        let path = root.join("a/adapter_model.safetensors");
        let (range, elem) = {
            let m = LoraAdapter::map(&root.join("a"), &model).unwrap();
            let (_, _, w) = m.iter().next().unwrap();
            (w.a.file_range().unwrap().1, w.a.dtype().size())
        };
        let mut bytes = std::fs::read(&path).unwrap();
        let nan: &[u8] = match elem {
            4 => &[0x00, 0x00, 0xc0, 0x7f],
            _ => &[0xc0, 0x7f],
        };
        bytes[range.start..range.start + elem].copy_from_slice(nan);
        std::fs::write(&path, &bytes).unwrap();
        let heap = LoraAdapter::load(&root.join("a"), &model).unwrap_err();
        for under in [None, Some(root.clone())] {
            let job = FetchJob {
                id: AdapterId(1),
                path: root.join("a"),
                root: under.clone(),
                bytes: None,
            };
            let e = read(&job, &model, None).unwrap_err();
            assert!(
                e.starts_with("reading adapter files at")
                    && e.contains("NaN or infinite values (element 0)")
                    && e.contains("fix them and load the adapter again"),
                "{e}"
            );
            assert!(heap.to_string().contains("NaN"), "{heap}");
            if under.is_some() {
                assert!(e.contains("<lora-root>/a"), "{e}");
                assert!(!e.contains(tmp.path().to_str().unwrap()), "{e}");
            }
        }
    }

    /// Every queued read is reported once, under its id, whichever thread read it; a missing
    /// directory fails alone, and its error names the path.
    #[test]
    fn every_read_is_reported_once_by_any_thread() {
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let good = tmp.path().join("a");
        copy_adapter(&good);
        let (tx, rx) = crossbeam::channel::unbounded();
        let loader = Loader::start(model, 3, None, move |id, r| {
            let _ = tx.send((id, r));
        })
        .unwrap();
        for k in 0..7u32 {
            let path = if k == 4 {
                tmp.path().join("missing")
            } else {
                good.clone()
            };
            let job = FetchJob {
                id: AdapterId(k),
                path,
                root: None,
                bytes: None,
            };
            assert!(loader.fetch(job));
        }
        let mut seen = Vec::new();
        for _ in 0..7 {
            let (id, r) = rx
                .recv_timeout(std::time::Duration::from_secs(60))
                .expect("every read is reported");
            match r {
                Err(e) => {
                    assert_eq!(id, AdapterId(4), "{e}");
                    assert!(e.contains("missing"), "{e}");
                }
                Ok((a, secs)) => {
                    assert_ne!(id, AdapterId(4));
                    assert!(a.size_bytes() > 0 && secs >= 0.0);
                }
            }
            seen.push(id.0);
        }
        drop(loader);
        assert!(rx.try_recv().is_err(), "a read reported twice");
        seen.sort();
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
    }
}
