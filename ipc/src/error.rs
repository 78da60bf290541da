//! The crate's error type.

use crate::segment::SegmentKind;

/// Everything that can go wrong creating, opening or using a shared-memory layout.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Sys {
        /// The operation (system call) that failed.
        op: &'static str,
        /// The errno it returned.
        #[source]
        source: nix::Error,
    },
    /// The segment's header does not start with Thaw's magic number.
    #[error("not a Thaw segment: magic {found:#018x}, expected {expected:#018x}")]
    BadMagic {
        /// Magic found in the header.
        found: u64,
        /// Magic this build writes.
        expected: u64,
    },
    /// The segment was written by another layout version.
    #[error(
        "segment layout version {found}, this build speaks {expected}; \
         start workers from the same binary as the server"
    )]
    VersionMismatch {
        /// Version found in the header.
        found: u32,
        /// Version this build writes.
        expected: u32,
    },
    /// The segment holds another layout than the caller asked for.
    #[error("segment holds layout kind {found}, expected {expected:?}")]
    KindMismatch {
        /// Kind code found in the header.
        found: u32,
        /// Kind the caller expected.
        expected: SegmentKind,
    },
    /// The header's recorded size differs from the fd's actual size.
    #[error("segment header records {header} bytes but the fd holds {actual} bytes")]
    SizeMismatch {
        /// Size recorded in the header.
        header: u64,
        /// Size of the file behind the fd.
        actual: u64,
    },
    /// The fd is too small for what must be in it.
    #[error("segment of {len} bytes is too small: need at least {needed}")]
    TooSmall {
        /// Size found.
        len: usize,
        /// Size required.
        needed: usize,
    },
    /// A requested size overflows what the platform can map.
    #[error("requested segment size {0} is too large")]
    TooLarge(usize),
    /// The fd lacks the grow/shrink/seal seals, so a peer could resize it under us.
    #[error("segment fd is not sealed against resizing; refusing to map it")]
    NotSealed,
    /// A debug name contained a NUL byte.
    #[error("segment debug name {0:?} contains a NUL byte")]
    BadName(String),
    /// The inherited fd could not be found or adopted.
    #[error("no inherited segment fd: {0}")]
    NoInheritedFd(String),
    /// A layout config is out of range.
    #[error("invalid layout config: {0}")]
    InvalidConfig(String),
    /// The header's config words do not describe a layout that fits the segment.
    #[error("segment header config is inconsistent: {0}")]
    CorruptHeader(String),
    /// The host store has no free block large enough.
    #[error(
        "host store full: adapter needs {needed} bytes, largest free block is {largest} of \
         {capacity}; evict adapters or raise the host store capacity"
    )]
    StoreFull {
        /// Bytes the adapter needs.
        needed: u64,
        /// Largest free block.
        largest: u64,
        /// Arena capacity.
        capacity: u64,
    },
    /// Every index slot of the host store is in use (live or awaiting reclaim).
    #[error("host store index full ({max} adapters); evict adapters or raise max_adapters")]
    IndexFull {
        /// Number of index slots.
        max: u32,
    },
    /// The (id, generation) pair is already live in the store.
    #[error("adapter {id} generation {generation} is already in the host store")]
    AlreadyPresent {
        /// Adapter id.
        id: u64,
        /// Generation.
        generation: u64,
    },
    /// Weights handed to the store are malformed.
    #[error("adapter weights for layer {layer} module {module}: {reason}")]
    BadWeights {
        /// Layer index.
        layer: u32,
        /// Module index (0..7 = q,k,v,o,gate,up,down).
        module: u32,
        /// What is wrong.
        reason: String,
    },
    /// A worker id beyond the layout's `max_workers`.
    #[error("worker {worker} out of range: the exchange has {max} worker slots")]
    NoSuchWorker {
        /// Requested worker.
        worker: u32,
        /// Slots in the layout.
        max: u32,
    },
    /// A reader slot beyond the store's `max_readers`.
    #[error("reader slot {slot} out of range: the host store has {max} reader slots")]
    NoSuchReader {
        /// Requested slot.
        slot: u32,
        /// Slots in the layout.
        max: u32,
    },
}

/// `Result` with [`IpcError`].
pub type Result<T, E = IpcError> = std::result::Result<T, E>;
