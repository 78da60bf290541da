//! The one place this crate memory-maps files: a read-only view of a weights file behind a
//! safe wrapper. Callers copy what they need out of it and drop it.

use std::fs::File;
use std::ops::Deref;
use std::path::Path;

use memmap2::Mmap;

/// The bytes of a file, memory-mapped when the file is non-empty.
pub(crate) enum FileBytes {
    Mapped(Mmap),
    Empty,
}

impl FileBytes {
    /// Opens and maps `path` read-only.
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        if file.metadata()?.len() == 0 {
            // Mapping zero bytes fails on some platforms; the parser reports an empty file.
            return Ok(Self::Empty);
        }
        // MAP_POPULATE: the file's pages are mapped in one call instead of one fault per
        // 4 KiB while the tensors are copied out (most of an adapter load's time otherwise).
        // SAFETY: the map is read-only and private to this process; the only hazard is another
        // process truncating or rewriting the file while it is mapped. Weights and adapter
        // files are immutable once written (HF/PEFT write a new file; Thaw's docs tell users
        // not to overwrite a file that is being loaded), and we copy the tensors out into
        // owned buffers right after parsing, so the window is the duration of one load.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file)? };
        Ok(Self::Mapped(map))
    }
}

/// Maps an open file read-only without reading it: pages come in from the page cache (or
/// the disk) as they are first touched, so mapping a large adapter costs microseconds and
/// its layers are read in the order they are used (the disk tier, `crate::adapter::MappedFile`).
pub(crate) fn map_lazily(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: as in `FileBytes::open`: read-only and private to this process; the hazard is
    // another process truncating the file while it is mapped, which adapter files are not
    // (immutable once written; the owner of the mapping checks the file's length and identity
    // against what it registered, see `MappedFile`). Here the mapping lives until the adapter
    // is unregistered, not for one load.
    unsafe { memmap2::MmapOptions::new().map(file) }
}

impl Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Empty => &[],
        }
    }
}

/// An empty `Vec<f32>` with room for `n` values whose pages are already committed: one
/// `MADV_POPULATE_WRITE` call instead of a page fault per 4 KiB as the values are written
/// (a fault costs microseconds under virtualisation; a 7 MB adapter takes ~1800 of them).
/// Best effort: where the kernel refuses (Linux < 5.14) pages fault in as usual.
pub(crate) fn committed_vec(n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    let spare = v.spare_capacity_mut();
    let start = spare.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(spare);
    let first = start.next_multiple_of(4096);
    let len = end.saturating_sub(first) & !4095;
    if len > 0 {
        // SAFETY: [first, first + len) lies inside `v`'s allocation (page-aligned inward), which
        // this function owns exclusively; MADV_POPULATE_WRITE only faults the pages in (zeroed
        // anonymous memory) and does not change what the allocator or any reference sees.
        unsafe {
            libc::madvise(first as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE);
        }
    }
    v
}
