//! The disk tier of an adapter: its factors read in place from the memory-mapped safetensors
//! file instead of copied into memory (DESIGN §3, issue 27).
//!
//! [`LoraAdapter::map`] parses and validates only the file's header (names, shapes, ranks,
//! dtypes — everything [`LoraAdapter::load`] checks but the values), which takes microseconds,
//! so a request can be admitted the moment it arrives: the CPU LoRA workers read each layer's
//! factors from the file as their jobs reach it ([`thaw_ipc::HostStore::insert_file`]), and the
//! upload pipeline reads the same pages into the host arena and the device. What `map` does not
//! check is that every weight is finite: that needs every byte, so the full load
//! ([`LoraAdapter::load`], on a loader thread) runs alongside and its result is authoritative
//! (a caller fails the adapter's requests if it finds a NaN, and swaps its owned copy in with
//! `Engine::adopt_host_copy` otherwise, which stops the engine's host copy reading the file).
//!
//! A mapped adapter keeps its file mapped while anything holds it: the upload pipeline until
//! its copy is done, and on the CPU backend the "device" copy itself, which is the host copy it
//! was registered with, until the adapter is unregistered. Like the base model's weights,
//! adapter files must not be rewritten in place while they are served (PEFT and Thaw's tools
//! write new files): a file truncated under a mapping faults on the next read of a lost page.
//! The workers check the file's length and identity at every step and refuse a changed file
//! with an error naming it (`thaw_cpu_lora::file_maps`).
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use safetensors::SafeTensors;
use thaw_ipc::{FileSource, FileTensors, LayerIdx, Module, ModuleShape};

use super::error::AdapterError;
use super::format::{open_dir, stored_dtype, unexpected};
use super::{LoraAdapter, LoraTensor, WeightDtype};
use crate::model::ModelConfig;

/// An adapter's safetensors file, mapped read-only, with the identity it had when mapped.
pub struct MappedFile {
    source: FileSource,
    map: memmap2::Mmap,
    /// Every weight read from this mapping was found finite ([`LoraAdapter::verify_in_place`]):
    /// the mapping is a full, validated host copy, not a stand-in until the loader's read.
    verified: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile")
            .field("source", &self.source)
            .finish()
    }
}

impl MappedFile {
    /// Opens and maps `path` (no page is read yet); records its length, device and inode.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let path = std::fs::canonicalize(path)?;
        let file = File::open(&path)?;
        Self::from_file(file, path)
    }

    /// Maps `file`, already open (for instance through a confined `openat` walk), whose real
    /// path is `path` (canonical; the workers reopen it there and check it is the same file).
    pub fn from_file(file: File, path: std::path::PathBuf) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        if meta.len() == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the file is empty",
            ));
        }
        let map = crate::model::map_lazily(&file)?;
        Ok(Self {
            source: FileSource {
                path,
                len: map.len() as u64,
                dev: meta.dev(),
                ino: meta.ino(),
            },
            map,
            verified: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Whether every weight read from this mapping was found finite.
    pub fn is_verified(&self) -> bool {
        self.verified.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records that every weight read from this mapping was found finite.
    pub(super) fn mark_verified(&self) {
        self.verified
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The file's path and identity as mapped.
    pub fn source(&self) -> &FileSource {
        &self.source
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

fn ipc_dtype(d: WeightDtype) -> thaw_ipc::DType {
    match d {
        WeightDtype::F32 => thaw_ipc::DType::F32,
        WeightDtype::F16 => thaw_ipc::DType::F16,
        WeightDtype::Bf16 => thaw_ipc::DType::BF16,
    }
}

impl LoraAdapter {
    /// Opens a PEFT adapter directory with its factors read in place from the mapped
    /// safetensors file: validated like [`LoraAdapter::load`] except that weights are not
    /// checked to be finite (see the module docs), and nothing but the header is read.
    pub fn map(dir: &Path, model: &ModelConfig) -> Result<Self, AdapterError> {
        let (config, path) = open_dir(dir)?;
        let file = MappedFile::open(&path).map_err(|e| AdapterError::Io {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Self::map_file(config, Arc::new(file), &path, model)
    }

    /// [`Self::map`] of an adapter whose config is read and whose safetensors file is mapped
    /// already; `path` names the file in errors.
    pub fn map_file(
        config: super::AdapterConfig,
        file: Arc<MappedFile>,
        path: &Path,
        model: &ModelConfig,
    ) -> Result<Self, AdapterError> {
        let path = path.to_path_buf();
        let tensors =
            SafeTensors::deserialize(file.bytes()).map_err(|e| AdapterError::Corrupt {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let base = file.bytes().as_ptr() as usize;
        Self::build(config, &tensors, model, |name, view| {
            let dtype = stored_dtype(name, view)?;
            let start = view.data().as_ptr() as usize - base;
            LoraTensor::mapped(dtype, file.clone(), start..start + view.data().len())
                .ok_or_else(|| unexpected(name, "its bytes are not whole elements inside the file"))
        })
    }

    /// When every factor is read in place from one mapped file: that file and each (layer,
    /// module)'s offsets in it, as a host-store file entry needs them. `None` for an adapter
    /// held in memory.
    pub fn file_source(&self) -> Option<(FileSource, Vec<FileTensors>)> {
        let mut file: Option<&Arc<MappedFile>> = None;
        let mut out = Vec::new();
        for (layer, m, w) in self.iter() {
            let (fa, ra) = w.a.file_range()?;
            let (fb, rb) = w.b.file_range()?;
            let f = *file.get_or_insert(fa);
            if !Arc::ptr_eq(f, fa) || !Arc::ptr_eq(f, fb) || w.a.dtype() != w.b.dtype() {
                return None;
            }
            let (d_out, d_in) = (w.b.numel() / w.rank, w.a.numel() / w.rank);
            out.push(FileTensors {
                layer: LayerIdx(layer as u32),
                module: Module::ALL[m.index()],
                shape: ModuleShape {
                    rank: w.rank as u32,
                    scale: w.scale,
                    dtype: ipc_dtype(w.a.dtype()),
                    d_in: d_in as u32,
                    d_out: d_out as u32,
                },
                a_off: ra.start as u64,
                b_off: rb.start as u64,
            });
        }
        Some((file?.source().clone(), out))
    }

    /// Whether any factor is read in place from a mapped file.
    pub fn is_mapped(&self) -> bool {
        self.iter()
            .any(|(_, _, w)| w.a.file_range().is_some() || w.b.file_range().is_some())
    }
}

#[cfg(test)]
#[path = "mapped_tests.rs"]
mod tests;
