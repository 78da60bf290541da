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
        // SAFETY: the map is read-only and private to this process; the only hazard is another
        // process truncating or rewriting the file while it is mapped. Weights and adapter
        // files are immutable once written (HF/PEFT write a new file; Thaw's docs tell users
        // not to overwrite a file that is being loaded), and we copy the tensors out into
        // owned buffers right after parsing, so the window is the duration of one load.
        let map = unsafe { Mmap::map(&file)? };
        Ok(Self::Mapped(map))
    }
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
