//! CUBINs kept on disk between processes, so a server start, a benchmark or a test process
//! loads the kernels it compiled before instead of running NVRTC again (every CUDA backend
//! compiles a dozen sources on first use; a GPU lease starts ten such processes).
//!
//! An entry is one file, `<source>-sm<arch>-<hash>.cubin`, holding a header (magic, the lengths
//! of the key text and of the CUBIN), the key text — the whole compiled source, the NVRTC
//! options and the arch — and the CUBIN. A read returns the CUBIN only when the stored key
//! text equals the current one byte for byte, so an edited kernel, other options or another
//! arch can never load a stale binary (the hash only names the file); a short, truncated or
//! foreign file is a miss. Writes go to a temporary file renamed into place, so concurrent
//! processes (parallel tests) never read half an entry. A failure to read or write the store
//! only costs a compile: it is never an error.
//!
//! Where: `THAW_KERNEL_CACHE_DIR` if set (`off` turns the store off), else
//! `$XDG_CACHE_HOME/thaw/kernels`, else `$HOME/.cache/thaw/kernels`.
use std::io::Write;
use std::path::{Path, PathBuf};

/// The variable naming the store's directory, or `off`.
pub const CACHE_DIR_ENV: &str = "THAW_KERNEL_CACHE_DIR";

const MAGIC: &[u8; 8] = b"THAWCUB1";

/// The store's directory from the environment's values (`var`), None when turned off or when
/// no directory can be named.
pub fn store_dir(var: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    match var(CACHE_DIR_ENV).filter(|v| !v.is_empty()) {
        Some(v) if v.eq_ignore_ascii_case("off") => None,
        Some(v) => Some(PathBuf::from(v)),
        None => var("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(|x| PathBuf::from(x).join("thaw/kernels"))
            .or_else(|| {
                var("HOME")
                    .filter(|v| !v.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache/thaw/kernels"))
            }),
    }
}

/// The text an entry must match: the compiled source, the options and the arch.
pub fn key_text(source: &str, options: &[String], arch: u32) -> String {
    format!("sm_{arch}\n{}\n{source}", options.join(" "))
}

/// FNV-1a, 64 bits: stable across builds and toolchains (it only names files; the key text
/// decides a hit).
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The entry's file for `name` (the source's name) and `key`.
pub fn entry_path(dir: &Path, name: &str, arch: u32, key: &str) -> PathBuf {
    dir.join(format!(
        "{name}-sm{arch}-{:016x}.cubin",
        fnv64(key.as_bytes())
    ))
}

/// An entry's bytes: magic, key length and CUBIN length (little-endian u64), key, CUBIN.
pub fn encode(key: &str, cubin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + key.len() + cubin.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(key.len() as u64).to_le_bytes());
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(cubin);
    out
}

/// The CUBIN of an entry's bytes when its key is `key` and it is whole; None otherwise.
pub fn decode<'a>(bytes: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let len = |b: &[u8]| -> Option<usize> {
        usize::try_from(u64::from_le_bytes(b.get(..8)?.try_into().ok()?)).ok()
    };
    let key_len = len(rest)?;
    let cubin_len = len(rest.get(8..)?)?;
    let body = rest.get(16..)?;
    let end = key_len.checked_add(cubin_len)?;
    if body.len() != end || key_len != key.len() || &body[..key_len] != key.as_bytes() {
        return None;
    }
    Some(&body[key_len..])
}

/// The stored CUBIN for `key`, if a whole entry with that very key is there.
pub fn load(dir: &Path, name: &str, arch: u32, key: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(entry_path(dir, name, arch, key)).ok()?;
    decode(&bytes, key).map(<[u8]>::to_vec)
}

/// Stores `cubin` for `key` (a temporary file renamed into place); errors are the caller's to
/// ignore.
pub fn store(dir: &Path, name: &str, arch: u32, key: &str, cubin: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = entry_path(dir, name, arch, key);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&encode(key, cubin))?;
    drop(f);
    std::fs::rename(&tmp, &path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Removes the entry for `key` (a stored CUBIN the driver refused to load).
pub fn forget(dir: &Path, name: &str, arch: u32, key: &str) {
    let _ = std::fs::remove_file(entry_path(dir, name, arch, key));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_directory_follows_the_variable_then_xdg_then_home() {
        let d = store_dir(env(&[(CACHE_DIR_ENV, "/x/k"), ("HOME", "/h")]));
        assert_eq!(d, Some(PathBuf::from("/x/k")));
        assert_eq!(
            store_dir(env(&[(CACHE_DIR_ENV, "OFF"), ("HOME", "/h")])),
            None
        );
        let d = store_dir(env(&[("XDG_CACHE_HOME", "/c"), ("HOME", "/h")]));
        assert_eq!(d, Some(PathBuf::from("/c/thaw/kernels")));
        let d = store_dir(env(&[(CACHE_DIR_ENV, ""), ("HOME", "/h")]));
        assert_eq!(d, Some(PathBuf::from("/h/.cache/thaw/kernels")));
        assert_eq!(store_dir(env(&[])), None);
    }

    #[test]
    fn a_stored_cubin_comes_back_only_for_its_own_key() {
        let dir = tempfile::tempdir().unwrap();
        let opts = vec!["--gpu-architecture=sm_90".to_string()];
        let key = key_text("__global__ void k() {}", &opts, 90);
        assert_eq!(load(dir.path(), "k", 90, &key), None, "empty store");
        store(dir.path(), "k", 90, &key, b"\x7fELF cubin").unwrap();
        assert_eq!(
            load(dir.path(), "k", 90, &key).as_deref(),
            Some(&b"\x7fELF cubin"[..])
        );
        // An edited source, other options, another arch: misses, whatever the file name.
        for other in [
            key_text("__global__ void k() { }", &opts, 90),
            key_text("__global__ void k() {}", &["--fmad=false".to_string()], 90),
            key_text("__global__ void k() {}", &opts, 80),
        ] {
            assert_eq!(load(dir.path(), "k", 90, &other), None);
            // Even written under the old key's file name (a hash collision): refused.
            let path = entry_path(dir.path(), "k", 90, &key);
            std::fs::write(&path, encode(&other, b"other")).unwrap();
            assert_eq!(load(dir.path(), "k", 90, &key), None);
        }
        // Forgotten: a miss; no temporary files left behind.
        store(dir.path(), "k", 90, &key, b"again").unwrap();
        forget(dir.path(), "k", 90, &key);
        assert_eq!(load(dir.path(), "k", 90, &key), None);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn the_file_name_is_stable_across_builds() {
        // FNV-1a's published test vectors: the name must not depend on the toolchain.
        assert_eq!(fnv64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv64(b"a"), 0xaf63_dc4c_8601_ec8c);
        let p = entry_path(Path::new("/d"), "attention", 90, "");
        assert_eq!(p, PathBuf::from("/d/attention-sm90-cbf29ce484222325.cubin"));
    }

    proptest! {
        /// Whole entries decode to their CUBIN; any truncation, any other key, any flipped
        /// header byte is a miss, never a wrong CUBIN.
        #[test]
        fn only_whole_entries_with_the_same_key_decode(
            key in ".{0,64}",
            other in ".{0,64}",
            cubin in proptest::collection::vec(any::<u8>(), 0..256),
            cut in 0usize..400,
            flip in 0usize..24,
        ) {
            let e = encode(&key, &cubin);
            prop_assert_eq!(decode(&e, &key), Some(&cubin[..]));
            if other != key {
                prop_assert_eq!(decode(&e, &other), None);
            }
            if cut < e.len() {
                prop_assert_eq!(decode(&e[..cut], &key), None);
            }
            let mut bad = e.clone();
            bad[flip] ^= 0x5a;
            prop_assert_eq!(decode(&bad, &key), None);
            let mut longer = e.clone();
            longer.push(0);
            prop_assert_eq!(decode(&longer, &key), None);
        }
    }
}
