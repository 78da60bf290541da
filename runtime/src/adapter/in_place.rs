//! An adapter's host copy read in place (issue 27: a file's bytes read from disk once).
//!
//! A disk-tier adapter used to be read twice: the upload pipeline read its mapped file layer by
//! layer into the arena while the loader read the whole file again into a heap copy, which then
//! became the host tier (for the CPU backend's compute, the engine thread's assist and the
//! workers' host store, which copied it once more at every load). [`LoraAdapter::load_in_place`]
//! is the loader's read without the heap copy: the file is mapped, its header validated as by
//! [`LoraAdapter::load`], and every weight checked finite where it lies, so the page cache's
//! pages are the only copy of the file's bytes in host memory. The pipeline encodes the same
//! pages into the arena (the device image), the CPU LoRA kernels read them in place, and the
//! workers' host-store entry names the file instead of holding a copy
//! ([`thaw_ipc::HostStore::insert_file`]), at every load.
//!
//! A verified mapping is a full host copy, not a stand-in: [`MappedFile::is_verified`]. What
//! it cannot protect against is what the base model's mapped weights cannot either: a file
//! rewritten in place while served (see [`super::mapped`]); a file *replaced* (a new file
//! renamed over it, as PEFT and Thaw's tools write) leaves the mapping on the old bytes, which
//! keep being served until the adapter is loaded again, as a heap copy did.
//!
//! Only an adapter kept in its stored dtype can be read in place: one the backend must convert
//! ([`LoraAdapter::into_dtype`]) is read into memory once and converted there.
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::error::AdapterError;
use super::{LoraAdapter, WeightDtype};
use crate::model::ModelConfig;

/// Bytes of adapter files this process read into memory (heap copies: every file that became
/// an adapter through [`LoraAdapter::from_file_bytes`], as [`LoraAdapter::load`] and the
/// server's confined reads do); reads in place are not counted: their pages are the page
/// cache's.
static COPIED: AtomicU64 = AtomicU64::new(0);

/// Bytes of adapter files read into memory by this process so far (heap copies): a read in
/// place adds nothing. For tests and reports.
pub fn file_bytes_copied() -> u64 {
    COPIED.load(Relaxed)
}

/// Counts `n` bytes of an adapter file read into memory.
pub(super) fn count_copied(n: usize) {
    COPIED.fetch_add(n as u64, Relaxed);
}

/// `THAW_LOAD_IN_PLACE=0` reads every adapter into memory as before (a heap copy beside the
/// page cache's): an attribution switch for benchmarks, never a configuration.
pub fn in_place_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !thaw_kernels::cpu::switched_off("THAW_LOAD_IN_PLACE"))
}

impl LoraAdapter {
    /// Checks every weight read in place from a mapped file is finite (reading each page once),
    /// and marks those files verified: the mapping is then a full host copy
    /// ([`LoraAdapter::is_verified`]). Factors held in memory were checked when read.
    pub fn verify_in_place(&self) -> Result<(), AdapterError> {
        for (layer, m, w) in self.iter() {
            for (t, factor) in [(&w.a, "lora_A"), (&w.b, "lora_B")] {
                if t.file_range().is_none() {
                    continue;
                }
                if let Some(index) = t.first_non_finite() {
                    return Err(AdapterError::NonFinite {
                        tensor: format!(
                            "base_model.model.{}.{factor}.weight",
                            m.module_path(layer)
                        ),
                        index,
                    });
                }
            }
        }
        for (_, _, w) in self.iter() {
            for t in [&w.a, &w.b] {
                if let Some((file, _)) = t.file_range() {
                    file.mark_verified();
                }
            }
        }
        Ok(())
    }

    /// Whether every factor read in place from a mapped file was verified whole
    /// ([`LoraAdapter::verify_in_place`]): true for an adapter held in memory.
    pub fn is_verified(&self) -> bool {
        self.iter().all(|(_, _, w)| {
            [&w.a, &w.b]
                .into_iter()
                .all(|t| t.file_range().is_none_or(|(f, _)| f.is_verified()))
        })
    }

    /// Whether it is a disk-tier stand-in: read in place from a mapped file not verified whole
    /// yet (served while the loader's full read of the file is still to come). A copy the
    /// loader read in place is verified: false.
    pub fn is_stand_in(&self) -> bool {
        self.is_mapped() && !self.is_verified()
    }

    /// Bytes of its factors held in memory (not read in place from a mapped file): what a host
    /// copy costs the heap. 0 for an adapter read in place, [`LoraAdapter::size_bytes`] for one
    /// read into memory.
    pub fn heap_bytes(&self) -> usize {
        self.iter()
            .flat_map(|(_, _, w)| [&w.a, &w.b])
            .filter(|t| t.file_range().is_none())
            .map(|t| t.bytes().len())
            .sum()
    }

    /// Whether a backend computing from `dtype` reads every factor as stored (`None`: it reads
    /// any stored dtype), so nothing needs converting.
    pub fn stored_as(&self, dtype: Option<WeightDtype>) -> bool {
        dtype.is_none_or(|d| {
            self.iter()
                .all(|(_, _, w)| w.a.dtype() == d && w.b.dtype() == d)
        })
    }

    /// [`LoraAdapter::load`] without a heap copy: mapped, validated like `load` (header,
    /// shapes, ranks, dtypes, and every weight finite, read in place) — see the module docs.
    pub fn load_in_place(dir: &Path, model: &ModelConfig) -> Result<Self, AdapterError> {
        let a = Self::map(dir, model)?;
        a.verify_in_place()?;
        Ok(a)
    }

    /// The host copy of `dir`'s adapter for a backend that computes from `dtype` (`None`: any
    /// stored dtype): read in place when the file stores what the backend reads (and
    /// [`in_place_enabled`]), else read into memory and converted once, here.
    pub fn load_host(
        dir: &Path,
        model: &ModelConfig,
        dtype: Option<WeightDtype>,
    ) -> Result<Self, AdapterError> {
        if in_place_enabled() {
            if let Ok(a) = Self::map(dir, model) {
                if a.stored_as(dtype) {
                    a.verify_in_place()?;
                    return Ok(a);
                }
            }
        }
        let a = Self::load(dir, model)?;
        Ok(match dtype {
            Some(d) => a.into_dtype(d),
            None => a,
        })
    }
}

#[cfg(test)]
#[path = "in_place_tests.rs"]
mod tests;
