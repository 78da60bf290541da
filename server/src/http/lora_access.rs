//! Who may load adapters at run time, and from where. `/v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter` answer 404 unless `--allow-runtime-lora-updating` (as vLLM does
//! without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`); with `--lora-root DIR` a `lora_path` must
//! resolve — symlinks and `..` followed — inside DIR, and every path that does not is refused
//! with the same 403 and the same message, so the answers say nothing about what exists
//! outside the root. Adapters given at start-up are not checked here.
use std::path::{Component, Path, PathBuf};

use thaw_runtime::adapter::{AdapterError, LoraAdapter};
use thaw_runtime::model::ModelConfig;

use crate::error::ServerError;
use crate::lora_open::{load_host_confined, relative, OpenError};

/// The files an adapter directory may hold that the loader opens.
const ADAPTER_FILES: [&str; 3] = [
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
];

/// The runtime adapter-loading policy.
#[derive(Clone, Debug, Default)]
pub struct LoraAccess {
    enabled: bool,
    /// Canonical `--lora-root`.
    root: Option<PathBuf>,
}

/// The one answer for every path outside the root, existing or not.
fn outside() -> ServerError {
    ServerError::Forbidden(
        "`lora_path` is not inside the server's --lora-root; runtime adapter loads may only \
         read adapter directories under that directory"
            .into(),
    )
}

/// `path` with `.` and `..` applied to its text, without touching the filesystem.
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

impl LoraAccess {
    /// `root` is resolved now; an unreadable root is a start-up error.
    pub fn new(enabled: bool, root: Option<&Path>) -> std::io::Result<Self> {
        let root = root.map(std::fs::canonicalize).transpose()?;
        Ok(Self { enabled, root })
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The canonical `--lora-root`, if any: the registry keeps it with each runtime-loaded
    /// adapter so the loader re-reads it under the same confinement.
    pub fn root(&self) -> Option<&Path> {
        self.root.as_deref()
    }

    /// The 404 the routes answer while runtime updates are off.
    pub fn disabled_error() -> ServerError {
        ServerError::NotFound(
            "runtime adapter loading and unloading is off; restart the server with \
             --allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), or \
             name adapters at start-up with --lora-modules / --lora-dir"
                .into(),
        )
    }

    /// The directory to load for a requested `lora_path`: unchanged without a root; with one,
    /// the canonical path inside it (a relative `lora_path` is taken relative to the root), or
    /// 403 for anything that resolves outside or through a link that cannot be resolved.
    pub fn resolve(&self, name: &str, lora_path: &str) -> Result<PathBuf, ServerError> {
        let Some(root) = &self.root else {
            return Ok(PathBuf::from(lora_path));
        };
        let requested = lexical(&root.join(lora_path));
        let dir = match std::fs::canonicalize(&requested) {
            Ok(dir) if dir.starts_with(root) => dir,
            Ok(_) => return Err(outside()),
            Err(_) => return Err(self.missing(name, &requested)),
        };
        for f in ADAPTER_FILES {
            let p = dir.join(f);
            if std::fs::symlink_metadata(&p).is_ok() {
                match std::fs::canonicalize(&p) {
                    Ok(c) if c.starts_with(root) => {}
                    _ => return Err(outside()),
                }
            }
        }
        Ok(dir)
    }

    /// The read of `dir` (from [`LoraAccess::resolve`]) for the registry's blocking pool: with
    /// a root, race-free and link-free relative to it (`lora_open`), answering the same 403 for
    /// a link swapped in since the check; without one, a plain load.
    pub fn reader(
        &self,
        name: &str,
        dir: &Path,
    ) -> impl FnOnce(&ModelConfig) -> Result<LoraAdapter, ServerError> + Send + 'static {
        let (access, name, dir) = (self.clone(), name.to_string(), dir.to_path_buf());
        move |model: &ModelConfig| {
            let adapter = |source| ServerError::Adapter {
                name: name.clone(),
                source,
            };
            // Read in place (no heap copy: the host tier is the file's pages and its image).
            let Some(root) = &access.root else {
                return LoraAdapter::load_host(&dir, model, None).map_err(adapter);
            };
            load_host_confined(root, &dir, model, None).map_err(|e| match e {
                OpenError::Outside => outside(),
                OpenError::Adapter(source) => access.relative_error(adapter(source)),
            })
        }
    }

    /// The error for a `requested` path that does not resolve: 403 unless its deepest
    /// resolvable ancestor is inside the root and no dangling link lies below that ancestor
    /// (a link's target is outside knowledge); then 404 naming the path relative to the root.
    fn missing(&self, name: &str, requested: &Path) -> ServerError {
        let Some(root) = &self.root else {
            return outside();
        };
        let found = requested
            .ancestors()
            .find_map(|a| Some((a, std::fs::canonicalize(a).ok()?)));
        let Some((ancestor, canonical)) = found else {
            return outside();
        };
        let rest = requested.strip_prefix(ancestor).unwrap_or(requested);
        let dangling = requested
            .ancestors()
            .take_while(|a| *a != ancestor)
            .any(|a| std::fs::symlink_metadata(a).is_ok_and(|m| m.file_type().is_symlink()));
        if !canonical.starts_with(root) || dangling {
            return outside();
        }
        self.relative_error(ServerError::Adapter {
            name: name.to_string(),
            source: AdapterError::NotFound {
                path: canonical.join(rest),
            },
        })
    }

    /// `e` with absolute paths under the root written as `<lora-root>/…`, so a client learns
    /// nothing about where the root lives.
    pub fn relative_error(&self, e: ServerError) -> ServerError {
        let Some(root) = &self.root else { return e };
        let ServerError::Adapter { name, source } = e else {
            return e;
        };
        let source = relative(root, source);
        ServerError::Adapter { name, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_applies_dots() {
        assert_eq!(lexical(Path::new("/a/b/../c/./d")), Path::new("/a/c/d"));
        assert_eq!(lexical(Path::new("/a/../../etc")), Path::new("/etc"));
    }

    #[cfg(unix)]
    #[test]
    fn confinement() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let good = root.join("good");
        std::fs::create_dir_all(&good).unwrap();
        std::fs::write(good.join("adapter_config.json"), "{}").unwrap();
        let outside_dir = tmp.path().join("secret");
        std::fs::create_dir_all(&outside_dir).unwrap();
        std::fs::write(outside_dir.join("adapter_config.json"), "{}").unwrap();
        std::os::unix::fs::symlink(&outside_dir, root.join("escape")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("nothing"), root.join("dangling")).unwrap();
        let leaky = root.join("leaky");
        std::fs::create_dir_all(&leaky).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", leaky.join("adapter_config.json")).unwrap();

        let acc = LoraAccess::new(true, Some(&root)).unwrap();
        let canon_good = std::fs::canonicalize(&good).unwrap();
        assert_eq!(
            acc.resolve("a", good.to_str().unwrap()).unwrap(),
            canon_good
        );
        assert_eq!(acc.resolve("a", "good").unwrap(), canon_good);
        assert_eq!(acc.resolve("a", "good/../good/.").unwrap(), canon_good);

        let refused = |p: &str| acc.resolve("a", p).unwrap_err();
        let first = refused("/etc/passwd");
        assert_eq!(first.status(), 403);
        for p in [
            "/etc",
            "/root",
            "/proc/self",
            "/definitely/not/here",
            "../secret",
            "good/../../secret",
            "escape",
            "dangling",
            "dangling/x",
            "leaky",
            outside_dir.to_str().unwrap(),
        ] {
            let e = refused(p);
            assert_eq!(e.status(), 403, "{p}");
            assert_eq!(
                e.to_string(),
                first.to_string(),
                "{p}: message must not vary"
            );
        }
        // Missing inside the root: 404 naming the path relative to the root.
        let e = refused("missing");
        assert_eq!(e.status(), 404);
        let msg = e.to_string();
        assert!(msg.contains("<lora-root>/missing"), "{msg}");
        assert!(!msg.contains(tmp.path().to_str().unwrap()), "{msg}");

        // No root: paths pass unchanged.
        let open = LoraAccess::new(true, None).unwrap();
        assert_eq!(open.resolve("a", "/x/y").unwrap(), PathBuf::from("/x/y"));
    }
}
