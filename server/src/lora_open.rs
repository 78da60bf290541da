//! Race-free reads of a runtime-loaded adapter under `--lora-root`: its first load (from the
//! HTTP route) and every re-read after the memory manager dropped its host copy (the loader
//! threads) go through [`load_confined`] with the same root.
//!
//! [`LoraAccess::resolve`](crate::http::LoraAccess::resolve) checks paths by name; a
//! component swapped for a symlink between that check and the open would escape the root.
//! So the adapter directory is opened once, walking down from the root one component at a
//! time with `openat(O_DIRECTORY | O_NOFOLLOW)` (the canonical path has no links, so any link
//! found now was swapped in and is refused), its real path is checked through
//! `/proc/self/fd`, and the adapter files are opened relative to that fd with `O_NOFOLLOW`.
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::Mode;
use thaw_runtime::adapter::{AdapterConfig, AdapterError, LoraAdapter, MappedFile};
use thaw_runtime::model::ModelConfig;

/// Why a confined read failed.
#[derive(Debug)]
pub enum OpenError {
    /// A link, a non-directory on the way, or a real path outside the root: the 403.
    Outside,
    /// The adapter files are missing, unreadable or invalid (paths relative to `dir`).
    Adapter(AdapterError),
}

fn open_at(dir: Option<&OwnedFd>, name: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
    let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    let fd = openat(dir.map(|d| d.as_raw_fd()), name, flags, Mode::empty())?;
    // SAFETY: `openat` just returned this descriptor and nothing else owns it; the OwnedFd
    // becomes its only owner and closes it once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens `dir` (canonical, inside the canonical `root`) without following any link.
fn open_dir(root: &Path, dir: &Path) -> Result<OwnedFd, OpenError> {
    let rel = dir.strip_prefix(root).map_err(|_| OpenError::Outside)?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY;
    let mut fd = open_at(None, root, flags).map_err(|_| OpenError::Outside)?;
    for c in rel.components() {
        let Component::Normal(name) = c else {
            return Err(OpenError::Outside);
        };
        fd = open_at(Some(&fd), Path::new(name), flags).map_err(|_| OpenError::Outside)?;
    }
    let real = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| OpenError::Outside)?;
    if !real.starts_with(root) {
        return Err(OpenError::Outside);
    }
    Ok(fd)
}

/// Regular file `name` in `dir_fd`, opened without following a link; `None` when it does not
/// exist.
fn open_file(dir_fd: &OwnedFd, dir: &Path, name: &str) -> Result<Option<std::fs::File>, OpenError> {
    let path = dir.join(name);
    let fd = match open_at(Some(dir_fd), Path::new(name), OFlag::O_RDONLY) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(None),
        // ELOOP: the file is a symlink. Whatever it points at is outside knowledge.
        Err(Errno::ELOOP) => return Err(OpenError::Outside),
        Err(e) => return Err(io_error(&path, e.to_string())),
    };
    let file = std::fs::File::from(fd);
    let meta = file
        .metadata()
        .map_err(|e| io_error(&path, e.to_string()))?;
    if !meta.is_file() {
        return Err(io_error(&path, "not a regular file".into()));
    }
    Ok(Some(file))
}

fn io_error(path: &Path, reason: String) -> OpenError {
    OpenError::Adapter(AdapterError::Io {
        path: path.to_path_buf(),
        reason,
    })
}

/// The bytes of regular file `name` in `dir_fd`; `None` when it does not exist.
fn read_file(dir_fd: &OwnedFd, dir: &Path, name: &str) -> Result<Option<Vec<u8>>, OpenError> {
    let Some(mut file) = open_file(dir_fd, dir, name)? else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| io_error(&dir.join(name), e.to_string()))?;
    Ok(Some(bytes))
}

/// `e` with absolute paths under `root` written as `<lora-root>/…`, so a client learns nothing
/// about where the root lives.
pub fn relative(root: &Path, e: AdapterError) -> AdapterError {
    let rel = |p: PathBuf| match p.strip_prefix(root) {
        Ok(r) => Path::new("<lora-root>").join(r),
        Err(_) => p,
    };
    use AdapterError as A;
    match e {
        A::NotFound { path } => A::NotFound { path: rel(path) },
        A::MissingFile { path } => A::MissingFile { path: rel(path) },
        A::PickleWeights { path } => A::PickleWeights { path: rel(path) },
        A::Io { path, reason } => A::Io {
            path: rel(path),
            reason,
        },
        A::ConfigNotJson { path, reason } => A::ConfigNotJson {
            path: rel(path),
            reason,
        },
        A::Corrupt { path, reason } => A::Corrupt {
            path: rel(path),
            reason,
        },
        other => other,
    }
}

const CONFIG: &str = "adapter_config.json";
const WEIGHTS: &str = "adapter_model.safetensors";

/// The adapter config in `fd` (the opened `dir`).
fn read_config(fd: &OwnedFd, dir: &Path) -> Result<AdapterConfig, OpenError> {
    let config_path = dir.join(CONFIG);
    let config = read_file(fd, dir, CONFIG)?.ok_or_else(|| {
        OpenError::Adapter(AdapterError::MissingFile {
            path: config_path.clone(),
        })
    })?;
    let text = String::from_utf8(config).map_err(|e| {
        OpenError::Adapter(AdapterError::ConfigNotJson {
            path: config_path.clone(),
            reason: e.to_string(),
        })
    })?;
    AdapterConfig::from_json(&text).map_err(|e| {
        OpenError::Adapter(match e {
            AdapterError::ConfigNotJson { reason, .. } => AdapterError::ConfigNotJson {
                path: config_path.clone(),
                reason,
            },
            e => e,
        })
    })
}

/// The error for a directory without a safetensors file: pickle weights, or missing.
fn no_weights(fd: &OwnedFd, dir: &Path) -> OpenError {
    let bin = "adapter_model.bin";
    OpenError::Adapter(match open_at(Some(fd), Path::new(bin), OFlag::O_RDONLY) {
        Ok(_) => AdapterError::PickleWeights {
            path: dir.join(bin),
        },
        Err(_) => AdapterError::MissingFile {
            path: dir.join(WEIGHTS),
        },
    })
}

/// Reads and validates the adapter in `dir` (canonical, under `root`) with no path lookup
/// that could follow a link out of the root.
pub fn load_confined(
    root: &Path,
    dir: &Path,
    model: &ModelConfig,
) -> Result<LoraAdapter, OpenError> {
    let fd = open_dir(root, dir)?;
    let config = read_config(&fd, dir)?;
    let Some(weights) = read_file(&fd, dir, WEIGHTS)? else {
        return Err(no_weights(&fd, dir));
    };
    // One read: the factors are ranges of these bytes, not copies.
    LoraAdapter::from_file_bytes(config, weights, &dir.join(WEIGHTS), model)
        .map_err(OpenError::Adapter)
}

/// [`LoraAdapter::map`] confined like [`load_confined`]: the safetensors file is opened
/// through the same link-refusing walk and mapped from that descriptor, its real path checked
/// to be under `root` (the CPU LoRA workers reopen it there and refuse a file that is not the
/// one mapped, by device and inode).
pub fn map_confined(
    root: &Path,
    dir: &Path,
    model: &ModelConfig,
) -> Result<LoraAdapter, OpenError> {
    let fd = open_dir(root, dir)?;
    let config = read_config(&fd, dir)?;
    let path = dir.join(WEIGHTS);
    let Some(file) = open_file(&fd, dir, WEIGHTS)? else {
        return Err(no_weights(&fd, dir));
    };
    let real = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|_| OpenError::Outside)?;
    if !real.starts_with(root) {
        return Err(OpenError::Outside);
    }
    let mapped = MappedFile::from_file(file, real).map_err(|e| io_error(&path, e.to_string()))?;
    LoraAdapter::map_file(config, Arc::new(mapped), &path, model).map_err(OpenError::Adapter)
}

/// The host copy of the adapter in `dir`, confined like [`load_confined`], for a backend that
/// computes from `dtype`: read in place where the backend reads the stored dtype (mapped
/// through [`map_confined`], every weight checked where it lies, no heap copy:
/// [`LoraAdapter::load_in_place`]); otherwise, or where the mapping fails, read into memory
/// (whose errors then say what is wrong) and converted once. The confined twin of
/// [`LoraAdapter::load_host`].
pub fn load_host_confined(
    root: &Path,
    dir: &Path,
    model: &ModelConfig,
    dtype: Option<thaw_runtime::adapter::WeightDtype>,
) -> Result<LoraAdapter, OpenError> {
    if thaw_runtime::adapter::in_place_enabled() {
        if let Ok(a) = map_confined(root, dir, model) {
            if a.stored_as(dtype) {
                a.verify_in_place().map_err(OpenError::Adapter)?;
                return Ok(a);
            }
        }
    }
    let a = load_confined(root, dir, model)?;
    Ok(match dtype {
        Some(d) => a.into_dtype(d),
        None => a,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::http::LoraAccess;

    pub(crate) fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny-llama")
    }

    /// Copies the fixture's rank-4 q/v PEFT adapter into `to`.
    pub(crate) fn copy_adapter(to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixture().join("adapters/r4_qv").join(f), to.join(f)).unwrap();
        }
    }

    /// The check passes, then the tree is changed under it (the TOCTOU window): each swap is
    /// refused by the read with the same 403 as any outside path; untouched adapters load.
    #[test]
    fn links_swapped_in_after_the_check_are_refused() {
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let secret = tmp.path().join("secret");
        copy_adapter(&secret);
        for a in [
            "good",
            "file_swap",
            "weights_swap",
            "dir_swap/inner",
            "parent_swap/a/b",
        ] {
            copy_adapter(&root.join(a));
        }
        let acc = LoraAccess::new(true, Some(&root)).unwrap();
        let outside_msg = acc.resolve("x", "/etc").unwrap_err().to_string();
        let checked = |p: &str| acc.resolve("x", p).unwrap();

        let good = checked("good");
        let adapter = acc.reader("x", &good)(&model).unwrap();
        let plain = LoraAdapter::load(&fixture().join("adapters/r4_qv"), &model).unwrap();
        assert_eq!(adapter.max_rank(), plain.max_rank());
        assert_eq!(adapter.size_bytes(), plain.size_bytes());

        let mut swapped = Vec::new();
        // A file replaced by a link to a file outside.
        let d = checked("file_swap");
        std::fs::remove_file(d.join("adapter_config.json")).unwrap();
        std::os::unix::fs::symlink(
            secret.join("adapter_config.json"),
            d.join("adapter_config.json"),
        )
        .unwrap();
        swapped.push(d);
        let d = checked("weights_swap");
        std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap();
        std::os::unix::fs::symlink(
            secret.join("adapter_model.safetensors"),
            d.join("adapter_model.safetensors"),
        )
        .unwrap();
        swapped.push(d);
        // The adapter directory itself, and a component above it, replaced by links.
        for (p, swap) in [
            ("dir_swap/inner", "dir_swap/inner"),
            ("parent_swap/a/b", "parent_swap/a"),
        ] {
            let d = checked(p);
            let s = root.join(swap);
            std::fs::rename(
                &s,
                tmp.path().join(format!("moved-{}", swap.replace('/', "-"))),
            )
            .unwrap();
            let target = if swap == p {
                secret.clone()
            } else {
                tmp.path().to_path_buf()
            };
            std::os::unix::fs::symlink(&target, &s).unwrap();
            swapped.push(d);
        }
        // parent_swap/a → tmp, so parent_swap/a/b would need tmp/b: make it a real adapter.
        copy_adapter(&tmp.path().join("b"));
        let real_root = std::fs::canonicalize(&root).unwrap();
        let mapped = map_confined(&real_root, &good, &model).unwrap();
        assert!(mapped.is_mapped());
        assert_eq!(mapped.size_bytes(), plain.size_bytes());
        for d in swapped {
            // Mapping goes through the same walk: refused too, never mapped from outside.
            let m = map_confined(&real_root, &d, &model);
            assert!(matches!(m, Err(OpenError::Outside)), "{}", d.display());
            let e = acc.reader("x", &d)(&model).unwrap_err();
            assert_eq!(e.status(), 403, "{}: {e}", d.display());
            assert_eq!(e.to_string(), outside_msg, "{}", d.display());
        }
        // A file missing at read time is a 404-class error naming the path relative to the root.
        let d = checked("good");
        std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap();
        let m = map_confined(&real_root, &d, &model);
        let Err(OpenError::Adapter(AdapterError::MissingFile { path })) = m else {
            panic!("{m:?}")
        };
        assert_eq!(path, d.join("adapter_model.safetensors"));
        let e = acc.reader("x", &d)(&model).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("<lora-root>/good/adapter_model.safetensors"),
            "{msg}"
        );
        assert!(!msg.contains(tmp.path().to_str().unwrap()), "{msg}");
    }
}
