//! File entries of the host store: an adapter the workers read from its safetensors file
//! before (or instead of) the arena holding its bytes — the disk tier of DESIGN §3.
//!
//! A file entry is an ordinary store entry (same index, leases, publication protocol and
//! reclaim as [`crate::store`]) whose block holds no weights: its descriptor table marks each
//! present (layer, module) `IN_FILE`, with `a_off`/`b_off` as byte offsets into the file, and a
//! trailer after the table names the file and the identity the engine saw when it registered
//! it (length, device, inode):
//!
//! ```text
//! block   n_layers × 7 ModuleDesc (present = IN_FILE, offsets into the file), 64 B aligned
//!         FileTrailer: magic, file length, st_dev, st_ino, path length
//!         path bytes (the file's absolute path, as the OS spells it)
//! ```
//!
//! Every (layer, module) is validated against the file length at insert and again by
//! [`AdapterLease::file_module`] when read, so a reader maps the file, compares its length and
//! identity with the trailer ([`FileSource::matches`]), and then only touches byte ranges
//! proven to lie inside it. The worker side (mapping, caching per adapter generation,
//! unmapping on retire) is `thaw_cpu_lora::file_maps`; this module never opens the file.

use std::ops::Range;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use bytemuck::{Pod, Zeroable};

use super::HostStore;
use crate::alloc::round_up;
use crate::error::{IpcError, Result};
use crate::store::{AdapterLease, ModuleDesc, StoreReader, DESC, IN_FILE, LIVE};
use crate::types::{AdapterHandle, AdapterId, DType, Generation, LayerIdx, Module, NUM_MODULES};

const TRAILER_MAGIC: u64 = u64::from_le_bytes(*b"THAWFILE");
/// Longest path a file entry stores (Linux's PATH_MAX).
pub const MAX_PATH: usize = 4096;

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
struct FileTrailer {
    magic: u64,
    len: u64,
    dev: u64,
    ino: u64,
    path_len: u64,
}

const TRAILER: usize = std::mem::size_of::<FileTrailer>();

/// The safetensors file of a file entry, as the engine saw it when it registered the adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSource {
    /// Absolute path.
    pub path: PathBuf,
    /// Length in bytes.
    pub len: u64,
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

impl FileSource {
    /// Reads the identity of the file at `path` (its length, device and inode).
    pub fn of(path: PathBuf) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&path)?;
        Ok(Self {
            path,
            len: m.len(),
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Whether an opened file (its metadata) is still this one, unchanged in length: a file
    /// replaced (new inode) or truncated/extended since registration is refused with the reason.
    pub fn matches(&self, m: &std::fs::Metadata) -> std::result::Result<(), String> {
        use std::os::unix::fs::MetadataExt;
        if (m.dev(), m.ino()) != (self.dev, self.ino) {
            return Err(format!(
                "{} was replaced since the adapter was registered; reload the adapter",
                self.path.display()
            ));
        }
        if m.len() != self.len {
            return Err(format!(
                "{} is {} bytes, {} when the adapter was registered (truncated or rewritten in \
                 place); reload the adapter",
                self.path.display(),
                m.len(),
                self.len
            ));
        }
        Ok(())
    }
}

/// The shape of one (layer, module) of an entry, wherever its bytes are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModuleShape {
    /// Rank.
    pub rank: u32,
    /// Scale (alpha / rank).
    pub scale: f32,
    /// Stored dtype.
    pub dtype: DType,
    /// Input features.
    pub d_in: u32,
    /// Output features.
    pub d_out: u32,
}

/// One (layer, module) whose A `[rank, d_in]` and B `[d_out, rank]` lie in the adapter's file
/// at byte offsets `a_off` and `b_off`, row-major, little-endian, in `dtype`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FileTensors {
    /// Layer.
    pub layer: LayerIdx,
    /// Module.
    pub module: Module,
    /// Shape, scale and dtype.
    pub shape: ModuleShape,
    /// Offset of A in the file.
    pub a_off: u64,
    /// Offset of B in the file.
    pub b_off: u64,
}

impl FileTensors {
    /// A's byte range in the file (`None` if its size overflows).
    pub fn a_range(&self) -> Option<Range<u64>> {
        let s = &self.shape;
        let n = u64::from(s.rank)
            .checked_mul(u64::from(s.d_in))?
            .checked_mul(s.dtype.size() as u64)?;
        Some(self.a_off..self.a_off.checked_add(n)?)
    }

    /// B's byte range in the file (`None` if its size overflows).
    pub fn b_range(&self) -> Option<Range<u64>> {
        let s = &self.shape;
        let n = u64::from(s.rank)
            .checked_mul(u64::from(s.d_out))?
            .checked_mul(s.dtype.size() as u64)?;
        Some(self.b_off..self.b_off.checked_add(n)?)
    }

    /// Checks the shape and that A and B lie inside a file of `file_len` bytes; the reason
    /// otherwise. What makes slicing a mapping of that length with these ranges sound.
    pub fn check(&self, file_len: u64) -> std::result::Result<(), String> {
        let s = &self.shape;
        if s.rank == 0 || s.d_in == 0 || s.d_out == 0 {
            return Err(format!(
                "rank {} d_in {} d_out {}: every dimension must be positive",
                s.rank, s.d_in, s.d_out
            ));
        }
        if !s.scale.is_finite() {
            return Err(format!("scale {} is not finite", s.scale));
        }
        for (what, r) in [("A", self.a_range()), ("B", self.b_range())] {
            match r {
                Some(r) if r.end <= file_len => {}
                Some(r) => {
                    return Err(format!(
                        "{what} bytes {}..{} lie outside the file's {file_len} bytes",
                        r.start, r.end
                    ))
                }
                None => return Err(format!("{what} is too large to address")),
            }
        }
        Ok(())
    }
}

/// Bytes of the descriptor table of an `n_layers` entry, rounded to the arena's alignment.
fn desc_bytes(n_layers: u32) -> usize {
    round_up((n_layers as usize * NUM_MODULES * DESC) as u64) as usize
}

impl HostStore {
    /// Publishes a file entry: adapter (`id`, `generation`) whose (layer, module) factors the
    /// readers take from `source` at the given offsets. Costs a few hundred bytes of arena
    /// and no copy of the weights. Each tensor pair is checked against `source.len`.
    pub fn insert_file(
        &mut self,
        id: AdapterId,
        generation: Generation,
        source: &FileSource,
        tensors: &[FileTensors],
    ) -> Result<AdapterHandle> {
        if self.live.contains_key(&(id, generation)) {
            return Err(IpcError::AlreadyPresent {
                id: id.0,
                generation: generation.0,
            });
        }
        let path = source.path.as_os_str().as_bytes();
        if path.is_empty() || path.len() > MAX_PATH || !source.path.is_absolute() {
            return Err(IpcError::InvalidConfig(format!(
                "file entry path {:?} must be absolute and at most {MAX_PATH} bytes",
                source.path
            )));
        }
        check_tensors(tensors, source.len)?;
        let n_layers = tensors.iter().map(|t| t.layer.0 + 1).max().unwrap_or(0);
        let table = desc_bytes(n_layers);
        let size = (table + TRAILER + path.len()) as u64;
        self.reclaim();
        let (slot, off, len) = self.take_entry(size)?;
        let base = self.reader.layout.arena + off as usize;
        // SAFETY: as in `insert`: [base, base+len) was just taken from the free list, its
        // entry is WRITING so no reader reaches it before the LIVE store below, and nothing
        // else in this process holds a slice of it.
        let block = unsafe {
            self.reader
                .seg
                .mapping()
                .slice_mut::<u8>(base, len as usize)
        };
        block[..table].fill(0);
        for t in tensors {
            let desc = ModuleDesc {
                present: IN_FILE,
                rank: t.shape.rank,
                dtype: t.shape.dtype.code(),
                d_in: t.shape.d_in,
                d_out: t.shape.d_out,
                scale: t.shape.scale,
                a_off: t.a_off,
                b_off: t.b_off,
                _pad: 0,
            };
            let at = (t.layer.0 as usize * NUM_MODULES + t.module.index()) * DESC;
            block[at..at + DESC].copy_from_slice(bytemuck::bytes_of(&desc));
        }
        let trailer = FileTrailer {
            magic: TRAILER_MAGIC,
            len: source.len,
            dev: source.dev,
            ino: source.ino,
            path_len: path.len() as u64,
        };
        block[table..table + TRAILER].copy_from_slice(bytemuck::bytes_of(&trailer));
        block[table + TRAILER..table + TRAILER + path.len()].copy_from_slice(path);
        let handle = AdapterHandle {
            id,
            generation,
            slot,
            _pad: 0,
        };
        self.reader
            .set_entry(slot, LIVE, Some((handle, n_layers, off, len)));
        self.live.insert((id, generation), (slot, off, len));
        self.blocks.insert(slot, (off, len));
        Ok(handle)
    }
}

/// Validates a file entry's tensors (as `check_weights` does an arena entry's).
fn check_tensors(tensors: &[FileTensors], file_len: u64) -> Result<()> {
    if tensors.is_empty() {
        return Err(IpcError::BadWeights {
            layer: 0,
            module: 0,
            reason: "no weights".into(),
        });
    }
    let mut seen = std::collections::HashSet::new();
    for t in tensors {
        let bad = |reason: String| IpcError::BadWeights {
            layer: t.layer.0,
            module: t.module.index() as u32,
            reason,
        };
        if !seen.insert((t.layer, t.module)) {
            return Err(bad("given twice".into()));
        }
        if t.layer.0 >= 1 << 16 {
            return Err(bad("layer index above 65535".into()));
        }
        t.check(file_len).map_err(bad)?;
    }
    Ok(())
}

impl AdapterLease<'_> {
    /// The descriptor of (layer, module), if inside the table.
    fn desc(&self, layer: LayerIdx, module: Module) -> Option<ModuleDesc> {
        if layer.0 >= self.n_layers {
            return None;
        }
        let at = self.block.0 + (layer.0 as usize * NUM_MODULES + module.index()) * DESC;
        // SAFETY: we hold a lease on an entry seen LIVE after taking it, so the block was
        // fully written before publication and is not written again while the lease lives;
        // the table lies inside the block (`StoreReader::lease` checked n_layers × 7 × DESC
        // against the block's length).
        Some(unsafe { self.store.seg.mapping().slice::<ModuleDesc>(at, 1) }[0])
    }

    fn trailer(&self) -> Option<FileTrailer> {
        let (start, len) = self.block;
        let at = start + desc_bytes(self.n_layers);
        if at + TRAILER > start + len {
            return None;
        }
        // SAFETY: as in `desc`: inside the leased, immutable block (checked just above); the
        // offset is 64-byte aligned (block start and table size both are).
        let t = unsafe { self.store.seg.mapping().slice::<FileTrailer>(at, 1) }[0];
        let path_end = (at + TRAILER).checked_add(usize::try_from(t.path_len).ok()?)?;
        (t.magic == TRAILER_MAGIC && t.path_len as usize <= MAX_PATH && path_end <= start + len)
            .then_some(t)
    }

    /// Whether this is a file entry: some (layer, module) lies in the file.
    pub fn is_file(&self) -> bool {
        (0..self.n_layers).any(|l| {
            Module::ALL.iter().any(|&m| {
                self.desc(LayerIdx(l), m)
                    .is_some_and(|d| d.present == IN_FILE)
            })
        })
    }

    /// The file a file entry reads from, as registered; `None` for an arena entry.
    pub fn file_source(&self) -> Option<FileSource> {
        if !self.is_file() {
            return None;
        }
        let t = self.trailer()?;
        let at = self.block.0 + desc_bytes(self.n_layers) + TRAILER;
        // SAFETY: inside the leased, immutable block (`trailer` checked the path's end).
        let path = unsafe {
            self.store
                .seg
                .mapping()
                .slice::<u8>(at, t.path_len as usize)
        };
        Some(FileSource {
            path: PathBuf::from(std::ffi::OsString::from_vec(path.to_vec())),
            len: t.len,
            dev: t.dev,
            ino: t.ino,
        })
    }

    /// (layer, module) of a file entry: its shape and byte offsets in the file, checked to lie
    /// inside the registered file length. `None` if absent, in the arena, or inconsistent.
    pub fn file_module(&self, layer: LayerIdx, module: Module) -> Option<FileTensors> {
        let d = self.desc(layer, module)?;
        if d.present != IN_FILE {
            return None;
        }
        let t = FileTensors {
            layer,
            module,
            shape: ModuleShape {
                rank: d.rank,
                scale: d.scale,
                dtype: DType::from_code(d.dtype)?,
                d_in: d.d_in,
                d_out: d.d_out,
            },
            a_off: d.a_off,
            b_off: d.b_off,
        };
        t.check(self.trailer()?.len).ok().map(|()| t)
    }
}

impl StoreReader {
    /// The shape of (layer, module) of `handle`'s adapter, from the arena or its file; `None`
    /// if the adapter is gone or does not target it.
    pub fn shape(
        &self,
        handle: AdapterHandle,
        layer: LayerIdx,
        module: Module,
    ) -> Option<ModuleShape> {
        let lease = self.lease(handle)?;
        if let Some(w) = lease.module(layer, module) {
            return Some(ModuleShape {
                rank: w.rank,
                scale: w.scale,
                dtype: w.dtype,
                d_in: w.d_in,
                d_out: w.d_out,
            });
        }
        lease.file_module(layer, module).map(|t| t.shape)
    }
}

#[cfg(test)]
#[path = "store_file_tests.rs"]
mod tests;
