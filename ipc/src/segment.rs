//! Sealed, anonymous shared-memory segments with a self-describing header.
//!
//! A segment is a memfd (no path, so nothing is left in `/dev/shm` when any process dies)
//! sealed against resizing, mapped shared. Byte 0 holds a [`SegmentHeader`]; the payload
//! starts at [`HEADER_LEN`] (page aligned, so it can be registered as pinned memory).
//! Workers get the fd by inheritance ([`Segment::inherit_into`] in the parent,
//! [`Segment::from_inherited_env`] in the child) and must validate it with
//! [`Segment::open_fd`]: a wrong magic, version, kind or size is an [`IpcError`].

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use crate::error::{IpcError, Result};
use crate::sys::{self, Mapping};

/// First 8 bytes of every segment: `"THAWIPC\0"` little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"THAWIPC\0");
/// Layout version; bump on any change to a header or a layout's offsets.
pub const LAYOUT_VERSION: u32 = 1;
/// Bytes reserved for the header; the payload starts here (one page).
pub const HEADER_LEN: usize = 4096;
/// Number of layout-specific config words in the header.
pub const CONFIG_WORDS: usize = 16;

/// Which layout a segment holds.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// The per-step exchange between the engine and CPU LoRA workers.
    Exchange = 1,
    /// The host adapter store.
    HostStore = 2,
    /// Untyped payload (tests, scratch buffers).
    Scratch = 3,
}

impl SegmentKind {
    fn code(self) -> u32 {
        self as u32
    }
}

/// The header at byte 0 of every segment. Written once at creation, before the fd is
/// shared; immutable afterwards.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct SegmentHeader {
    /// [`MAGIC`].
    pub magic: u64,
    /// [`LAYOUT_VERSION`].
    pub version: u32,
    /// [`SegmentKind`] code.
    pub kind: u32,
    /// Total size of the segment in bytes (header included); must equal the fd's size.
    pub total_len: u64,
    /// Offset of the payload ([`HEADER_LEN`]).
    pub payload_off: u64,
    /// Layout-specific configuration (e.g. the exchange's capacities).
    pub config: [u64; CONFIG_WORDS],
    /// NUL-padded debug name.
    pub debug_name: [u8; 32],
}

/// A mapped, validated shared-memory segment. Dropping it unmaps and closes the fd.
pub struct Segment {
    /// Shared with the host store's fill tokens, which may outlive the segment's owner.
    map: Arc<Mapping>,
    fd: OwnedFd,
    header: SegmentHeader,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("kind", &self.kind())
            .field("len", &self.len())
            .field("name", &self.debug_name())
            .finish()
    }
}

fn file_of(fd: BorrowedFd<'_>) -> Result<File> {
    let dup = fd.try_clone_to_owned().map_err(|e| IpcError::Sys {
        op: "dup",
        source: nix::Error::from_raw(e.raw_os_error().unwrap_or(0)),
    })?;
    Ok(File::from(dup))
}

fn io_err(op: &'static str) -> impl FnOnce(std::io::Error) -> IpcError {
    move |e| IpcError::Sys {
        op,
        source: nix::Error::from_raw(e.raw_os_error().unwrap_or(0)),
    }
}

impl Segment {
    /// Creates a segment with `payload_len` zeroed payload bytes and no config words.
    pub fn create(kind: SegmentKind, debug_name: &str, payload_len: usize) -> Result<Self> {
        Self::create_with_config(kind, debug_name, payload_len, &[])
    }

    /// Creates a segment whose header carries `config` (at most [`CONFIG_WORDS`] words).
    pub fn create_with_config(
        kind: SegmentKind,
        debug_name: &str,
        payload_len: usize,
        config: &[u64],
    ) -> Result<Self> {
        if config.len() > CONFIG_WORDS {
            return Err(IpcError::InvalidConfig(format!(
                "{} config words, at most {CONFIG_WORDS}",
                config.len()
            )));
        }
        let total = payload_len
            .checked_add(HEADER_LEN + 4095)
            .ok_or(IpcError::TooLarge(payload_len))?
            & !4095;
        let fd = sys::memfd_sealed(debug_name, total)?;
        let mut header = SegmentHeader {
            magic: MAGIC,
            version: LAYOUT_VERSION,
            kind: kind.code(),
            total_len: total as u64,
            payload_off: HEADER_LEN as u64,
            config: [0; CONFIG_WORDS],
            debug_name: [0; 32],
        };
        header.config[..config.len()].copy_from_slice(config);
        let n = debug_name.len().min(31);
        header.debug_name[..n].copy_from_slice(&debug_name.as_bytes()[..n]);
        // The header goes in through the file, before anything maps it.
        file_of(fd.as_fd())?
            .write_all_at(bytemuck::bytes_of(&header), 0)
            .map_err(io_err("pwrite header"))?;
        Self::open_fd(fd, kind)
    }

    /// Validates and maps a segment received as an fd. Refuses, with the specific error, a
    /// file that is not sealed, too small, or whose header has the wrong magic, version or
    /// kind, or records a size other than the fd's.
    pub fn open_fd(fd: OwnedFd, expected: SegmentKind) -> Result<Self> {
        let len = sys::fd_len(fd.as_fd())?;
        let hsize = std::mem::size_of::<SegmentHeader>();
        if len < HEADER_LEN {
            return Err(IpcError::TooSmall {
                len,
                needed: HEADER_LEN,
            });
        }
        if !sys::fd_seals(fd.as_fd())?.contains(sys::REQUIRED_SEALS) {
            return Err(IpcError::NotSealed);
        }
        let mut header = SegmentHeader::zeroed();
        file_of(fd.as_fd())?
            .read_exact_at(&mut bytemuck::bytes_of_mut(&mut header)[..hsize], 0)
            .map_err(io_err("pread header"))?;
        if header.magic != MAGIC {
            return Err(IpcError::BadMagic {
                found: header.magic,
                expected: MAGIC,
            });
        }
        if header.version != LAYOUT_VERSION {
            return Err(IpcError::VersionMismatch {
                found: header.version,
                expected: LAYOUT_VERSION,
            });
        }
        if header.kind != expected.code() {
            return Err(IpcError::KindMismatch {
                found: header.kind,
                expected,
            });
        }
        if header.total_len != len as u64 {
            return Err(IpcError::SizeMismatch {
                header: header.total_len,
                actual: len as u64,
            });
        }
        if header.payload_off != HEADER_LEN as u64 {
            return Err(IpcError::CorruptHeader(format!(
                "payload offset {} (expected {HEADER_LEN})",
                header.payload_off
            )));
        }
        let map = Arc::new(Mapping::map(fd.as_fd(), len)?);
        Ok(Self { map, fd, header })
    }

    /// Adopts the segment fd whose number the parent put in environment variable `var`
    /// (see [`Segment::inherit_into`]) and validates it like [`Segment::open_fd`].
    pub fn from_inherited_env(var: &str, expected: SegmentKind) -> Result<Self> {
        let raw = std::env::var(var)
            .map_err(|_| IpcError::NoInheritedFd(format!("environment variable {var} not set")))?;
        let raw: RawFd = raw
            .trim()
            .parse()
            .map_err(|_| IpcError::NoInheritedFd(format!("{var}={raw:?} is not an fd number")))?;
        Self::open_fd(sys::adopt_inherited_fd(raw)?, expected)
    }

    /// Makes this segment's fd survive `exec` in the child `cmd` spawns (only in that child:
    /// the parent's fd stays close-on-exec) and passes its number in `env_var`. Keep `self`
    /// alive until the child has been spawned.
    pub fn inherit_into(&self, cmd: &mut Command, env_var: &str) -> RawFd {
        let raw = sys::inherit_into(cmd, self.fd.as_fd());
        cmd.env(env_var, raw.to_string());
        raw
    }

    /// A new fd for the same memory (e.g. to open a second mapping, or to send over a
    /// socket with `SCM_RIGHTS`).
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(io_err("dup segment fd"))
    }

    /// Which layout this segment holds.
    pub fn kind(&self) -> SegmentKind {
        match self.header.kind {
            1 => SegmentKind::Exchange,
            2 => SegmentKind::HostStore,
            _ => SegmentKind::Scratch,
        }
    }

    /// The immutable header.
    pub fn header(&self) -> &SegmentHeader {
        &self.header
    }

    /// The header's layout-specific config words.
    pub fn config_words(&self) -> &[u64; CONFIG_WORDS] {
        &self.header.config
    }

    /// The debug name given at creation.
    pub fn debug_name(&self) -> &str {
        let n = self
            .header
            .debug_name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(32);
        std::str::from_utf8(&self.header.debug_name[..n]).unwrap_or("?")
    }

    /// Total size in bytes, header included.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Always false: a segment has at least its header.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Offset of the payload from the segment start.
    pub fn payload_offset(&self) -> usize {
        HEADER_LEN
    }

    /// Bytes available to the payload.
    pub fn payload_len(&self) -> usize {
        self.map.len() - HEADER_LEN
    }

    /// Address of byte 0 in this process (for `cuMemHostRegister`; never store it in the
    /// segment: other processes map it elsewhere).
    pub fn base_addr(&self) -> usize {
        self.map.addr()
    }

    /// The `AtomicU32` at `off` bytes from the segment start. Panics if `off` is in the
    /// header, out of range or not 4-aligned.
    pub fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off >= HEADER_LEN,
            "offset {off} is inside the immutable header"
        );
        self.map.atomic_u32(off)
    }

    /// The `AtomicU64` at `off` bytes from the segment start. Panics if `off` is in the
    /// header, out of range or not 8-aligned.
    pub fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off >= HEADER_LEN,
            "offset {off} is inside the immutable header"
        );
        self.map.atomic_u64(off)
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// The mapping, kept alive by the caller too (a store fill running on another thread).
    pub(crate) fn shared_mapping(&self) -> Arc<Mapping> {
        self.map.clone()
    }

    /// Commits every page of the segment now (see `Mapping::populate_write`); false where
    /// the kernel cannot, in which case pages fault in on first use.
    pub fn populate(&self) -> bool {
        self.map.populate_write()
    }
}

impl AsFd for Segment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sealed memfd holding `header` (as bytes) and `len` bytes in all.
    fn crafted(header: &SegmentHeader, len: usize) -> OwnedFd {
        let fd = sys::memfd_sealed("crafted", len).unwrap();
        file_of(fd.as_fd())
            .unwrap()
            .write_all_at(bytemuck::bytes_of(header), 0)
            .unwrap();
        fd
    }

    fn good_header(len: usize) -> SegmentHeader {
        SegmentHeader {
            magic: MAGIC,
            version: LAYOUT_VERSION,
            kind: SegmentKind::Scratch as u32,
            total_len: len as u64,
            payload_off: HEADER_LEN as u64,
            ..Zeroable::zeroed()
        }
    }

    #[test]
    fn crafted_good_header_opens() {
        let len = 2 * HEADER_LEN;
        let seg = Segment::open_fd(crafted(&good_header(len), len), SegmentKind::Scratch).unwrap();
        assert_eq!(seg.payload_len(), HEADER_LEN);
    }

    #[test]
    fn wrong_magic_is_refused() {
        let len = 2 * HEADER_LEN;
        let h = SegmentHeader {
            magic: 0xdead_beef,
            ..good_header(len)
        };
        let err = Segment::open_fd(crafted(&h, len), SegmentKind::Scratch).unwrap_err();
        assert!(
            matches!(
                err,
                IpcError::BadMagic {
                    found: 0xdead_beef,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn wrong_version_is_refused() {
        let len = 2 * HEADER_LEN;
        let h = SegmentHeader {
            version: LAYOUT_VERSION + 1,
            ..good_header(len)
        };
        let err = Segment::open_fd(crafted(&h, len), SegmentKind::Scratch).unwrap_err();
        assert!(matches!(err, IpcError::VersionMismatch { .. }), "{err}");
    }

    #[test]
    fn wrong_kind_is_refused() {
        let seg = Segment::create(SegmentKind::Scratch, "kind", 100).unwrap();
        let err = Segment::open_fd(seg.try_clone_fd().unwrap(), SegmentKind::Exchange).unwrap_err();
        assert!(
            matches!(
                err,
                IpcError::KindMismatch {
                    found: 3,
                    expected: SegmentKind::Exchange
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn wrong_size_is_refused() {
        let len = 2 * HEADER_LEN;
        let h = SegmentHeader {
            total_len: 3 * HEADER_LEN as u64,
            ..good_header(len)
        };
        let err = Segment::open_fd(crafted(&h, len), SegmentKind::Scratch).unwrap_err();
        assert!(
            matches!(err, IpcError::SizeMismatch { header, actual } if header == 3 * 4096 && actual == 2 * 4096),
            "{err}"
        );
    }

    #[test]
    fn too_small_and_unsealed_are_refused() {
        let fd = sys::memfd_sealed("tiny", 64).unwrap();
        let err = Segment::open_fd(fd, SegmentKind::Scratch).unwrap_err();
        assert!(matches!(err, IpcError::TooSmall { len: 64, .. }), "{err}");

        let name = std::ffi::CString::new("unsealed").unwrap();
        let fd =
            nix::sys::memfd::memfd_create(&name, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
                .unwrap();
        nix::unistd::ftruncate(&fd, 2 * HEADER_LEN as i64).unwrap();
        let err = Segment::open_fd(fd, SegmentKind::Scratch).unwrap_err();
        assert!(
            matches!(err, IpcError::Sys { .. } | IpcError::NotSealed),
            "{err}"
        );
    }

    #[test]
    fn two_mappings_share_memory() {
        let a = Segment::create(SegmentKind::Scratch, "share", 4096).unwrap();
        let b = Segment::open_fd(a.try_clone_fd().unwrap(), SegmentKind::Scratch).unwrap();
        assert_ne!(a.base_addr(), b.base_addr());
        a.atomic_u64(HEADER_LEN + 8)
            .store(42, std::sync::atomic::Ordering::Release);
        assert_eq!(
            b.atomic_u64(HEADER_LEN + 8)
                .load(std::sync::atomic::Ordering::Acquire),
            42
        );
        assert_eq!(b.debug_name(), "share");
    }
}
