//! A worker's mappings of adapter files: the disk tier of CPU assist (DESIGN §3, issue 27).
//!
//! For a host-store *file entry* ([`thaw_ipc::HostStore::insert_file`]) the worker maps the
//! adapter's safetensors file read-only, once per adapter generation, and reads each job's
//! (layer, module) factors straight from it — the page cache's pages, read layer by layer as
//! the jobs reach them, while the engine's loader reads the same file into the arena. The
//! mapping is checked against the file the engine registered (length, device, inode) before
//! use and at every step, and dropped once the entry is retired from the store.

use std::collections::HashMap;
use std::fs::File;

use thaw_ipc::{AdapterHandle, AdapterId, Generation, LayerIdx, LoraWeights, Module, StoreReader};

/// One mapped file, or why it could not be used.
struct Mapped {
    file: File,
    map: memmap2::Mmap,
    /// Registered length (what `map` covers).
    len: u64,
}

/// Mappings of the adapter files this process reads, by adapter generation.
#[derive(Default)]
pub struct FileMaps {
    maps: HashMap<(AdapterId, Generation), Result<Mapped, String>>,
}

impl std::fmt::Debug for FileMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileMaps")
            .field("mapped", &self.maps.len())
            .finish()
    }
}

impl FileMaps {
    /// Files currently mapped (or remembered as failed).
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// Between steps: unmaps the files of entries no longer live in `store` (retired or
    /// replaced by a new generation), and stops using a file whose length changed since it
    /// was mapped (truncated or extended in place), so no later access reaches past its end.
    pub fn tend(&mut self, store: &StoreReader) {
        if self.maps.is_empty() {
            return;
        }
        self.maps
            .retain(|&(id, generation), _| store.lookup(id, generation).is_some());
        for m in self.maps.values_mut() {
            let changed = match m {
                Ok(f) => match f.file.metadata() {
                    Ok(meta) if meta.len() == f.len => None,
                    Ok(meta) => Some(format!(
                        "the adapter file changed length ({} → {} bytes) while in use; \
                         reload the adapter",
                        f.len,
                        meta.len()
                    )),
                    Err(e) => Some(format!("the adapter file cannot be read: {e}")),
                },
                Err(_) => None,
            };
            if let Some(why) = changed {
                *m = Err(why);
            }
        }
    }

    /// The factors of (layer, module) of `handle`'s adapter when it is a file entry, read in
    /// place from the mapped file. `Ok(None)`: the adapter is gone or this (layer, module) is
    /// not in a file. `Err`: the file cannot be used (missing, replaced, truncated), with the
    /// reason.
    pub fn weights(
        &mut self,
        store: &StoreReader,
        handle: AdapterHandle,
        layer: LayerIdx,
        module: Module,
    ) -> Result<Option<LoraWeights<'_>>, String> {
        let Some(lease) = store.lease(handle) else {
            return Ok(None);
        };
        let Some(t) = lease.file_module(layer, module) else {
            return Ok(None);
        };
        let key = (handle.id, handle.generation);
        let m = self.maps.entry(key).or_insert_with(|| {
            lease
                .file_source()
                .ok_or_else(|| "the host store's file entry names no file".to_string())
                .and_then(|src| open(&src))
        });
        drop(lease);
        let m = match m {
            Ok(m) => m,
            Err(e) => return Err(e.clone()),
        };
        // `file_module` checked both ranges against the registered length, which `open`
        // checked the file (and so the mapping) has.
        let (a, b) = match (t.a_range(), t.b_range()) {
            (Some(a), Some(b)) if a.end <= m.len && b.end <= m.len => (a, b),
            _ => return Err(format!("{layer:?} {module:?} lies outside the file")),
        };
        Ok(Some(LoraWeights {
            rank: t.shape.rank,
            scale: t.shape.scale,
            dtype: t.shape.dtype,
            d_in: t.shape.d_in,
            d_out: t.shape.d_out,
            a: &m.map[a.start as usize..a.end as usize],
            b: &m.map[b.start as usize..b.end as usize],
        }))
    }
}

/// Why `handle`'s adapter cannot be read from its file, if it is a file entry whose file is
/// no longer the one registered (removed, replaced, truncated, unreadable): its path and the
/// reason. `None` for an entry held in memory, a file that still checks out, or an entry
/// already gone. The engine asks it when a worker reports failed jobs, to name the adapter,
/// the file and what to do.
pub fn diagnose(
    store: &StoreReader,
    handle: AdapterHandle,
) -> Option<(std::path::PathBuf, String)> {
    let src = store.lease(handle)?.file_source()?;
    check(&src).err().map(|why| (src.path, why))
}

/// Opens the registered file after checking it is still the one registered.
fn check(src: &thaw_ipc::FileSource) -> Result<File, String> {
    let what = |e: std::io::Error| format!("cannot read {}: {e}", src.path.display());
    let file = File::open(&src.path).map_err(what)?;
    let meta = file.metadata().map_err(what)?;
    src.matches(&meta)?;
    if src.len == 0 {
        return Err(format!("{} is empty", src.path.display()));
    }
    Ok(file)
}

/// Opens and maps the registered file after checking it is still the one registered.
fn open(src: &thaw_ipc::FileSource) -> Result<Mapped, String> {
    let what = |e: std::io::Error| format!("cannot read {}: {e}", src.path.display());
    let file = check(src)?;
    let map = crate::sys::map_readonly(&file).map_err(what)?;
    if map.len() as u64 != src.len {
        return Err(format!(
            "{} mapped {} bytes, {} registered",
            src.path.display(),
            map.len(),
            src.len
        ));
    }
    Ok(Mapped {
        file,
        map,
        len: src.len,
    })
}

#[cfg(test)]
#[path = "file_maps_tests.rs"]
mod tests;
