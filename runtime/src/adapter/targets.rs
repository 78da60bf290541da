//! PEFT's module-name matching, for `target_modules`, `exclude_modules`, `rank_pattern` and
//! `alpha_pattern`. Names are matched in the two forms PEFT uses: relative to the
//! `*ForCausalLM` model (`model.layers.3.self_attn.q_proj`) and as saved in the adapter
//! (`base_model.model.model.layers.3.self_attn.q_proj`).

use std::collections::BTreeMap;

use regex::Regex;

use super::error::AdapterError;
use super::module::LoraModule;

/// A Python `re` pattern that PEFT applies with `re.fullmatch`.
#[derive(Clone, Debug)]
pub struct FullMatch {
    source: String,
    re: Regex,
}

impl PartialEq for FullMatch {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl FullMatch {
    pub fn new(field: &str, source: &str) -> Result<Self, AdapterError> {
        let re = Regex::new(&format!("^(?:{source})$")).map_err(|e| AdapterError::InvalidConfig {
            field: field.to_string(),
            reason: format!(
                "`{source}` is not a regex Thaw can evaluate ({e}); list the module names instead, e.g. [\"q_proj\", \"v_proj\"]"
            ),
        })?;
        Ok(Self {
            source: source.to_string(),
            re,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn is_match(&self, name: &str) -> bool {
        self.re.is_match(name)
    }
}

/// `target_modules` / `exclude_modules`: a list of names (a module matches a name when its
/// path equals it or ends with `.name`) or one regex (full match on the path).
#[derive(Clone, Debug, PartialEq)]
pub enum TargetSpec {
    Names(Vec<String>),
    Regex(FullMatch),
}

/// Both spellings of a module's path that PEFT may have matched against.
fn paths(layer: usize, m: LoraModule) -> [String; 2] {
    let rel = m.module_path(layer);
    let full = format!("base_model.model.{rel}");
    [rel, full]
}

fn name_matches(path: &str, key: &str) -> bool {
    path == key
        || (path.len() > key.len()
            && path.ends_with(key)
            && path[..path.len() - key.len()].ends_with('.'))
}

impl TargetSpec {
    /// Whether this spec selects projection `m` of layer `layer`.
    pub fn matches(&self, layer: usize, m: LoraModule) -> bool {
        paths(layer, m).iter().any(|p| self.matches_path(p))
    }

    /// Whether this spec could select projection `m` at some layer: a name selects a path only
    /// as a whole dotted suffix of it, so its last segment must be `m`'s name. False means
    /// `matches(l, m)` is false for every layer, so callers can skip probing layers (which
    /// formats two paths per layer: with hundreds of probe layers it was most of an adapter's
    /// load time).
    pub fn may_match(&self, m: LoraModule) -> bool {
        match self {
            Self::Names(keys) => keys
                .iter()
                .any(|k| k.rsplit('.').next() == Some(m.hf_name())),
            Self::Regex(_) => true,
        }
    }

    /// Whether this spec selects the module at `path` (any module, not only projections).
    pub fn matches_path(&self, path: &str) -> bool {
        match self {
            Self::Names(keys) => keys.iter().any(|k| name_matches(path, k)),
            Self::Regex(re) => re.is_match(path),
        }
    }
}

/// Keys made only of identifier characters and dots are matched literally (as a suffix); the
/// rest as the regex `(.*\.)?key$`, as PEFT does.
fn is_literal(key: &str) -> bool {
    key.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

/// The `rank_pattern` / `alpha_pattern` entry for (layer, module): an exact path match first,
/// then the longest key the path ends with (as `.key`), then the first key that matches as the
/// regex `(.*\.)?key$`.
pub fn pattern_lookup<V: Copy>(
    map: &BTreeMap<String, V>,
    layer: usize,
    m: LoraModule,
) -> Option<V> {
    if map.is_empty() {
        return None;
    }
    let paths = paths(layer, m);
    if let Some(v) = paths.iter().find_map(|p| map.get(p)) {
        return Some(*v);
    }
    let suffix = map
        .iter()
        .filter(|(k, _)| paths.iter().any(|p| name_matches(p, k)))
        .max_by_key(|(k, _)| k.len());
    if let Some((_, v)) = suffix {
        return Some(*v);
    }
    map.iter()
        .filter(|(k, _)| !is_literal(k))
        .find(|(k, _)| {
            Regex::new(&format!(r"^(?:.*\.)?(?:{k})$"))
                .map(|re| paths.iter().any(|p| re.is_match(p)))
                .unwrap_or(false)
        })
        .map(|(_, v)| *v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_as_dotted_suffixes() {
        let spec = TargetSpec::Names(vec!["q_proj".into(), "layers.1.mlp.down_proj".into()]);
        assert!(spec.matches(0, LoraModule::Q));
        assert!(!spec.matches(0, LoraModule::K));
        assert!(spec.matches(1, LoraModule::Down));
        assert!(!spec.matches(11, LoraModule::Down));
        assert!(!TargetSpec::Names(vec!["proj".into()]).matches(0, LoraModule::Q));
    }

    #[test]
    fn may_match_is_false_only_where_no_layer_matches() {
        let keys = [
            "q_proj",
            "layers.1.mlp.down_proj",
            "proj",
            "self_attn.v_proj",
            "",
        ];
        for key in keys {
            let spec = TargetSpec::Names(vec![key.to_string()]);
            for m in LoraModule::ALL {
                let any = (0..16).any(|l| spec.matches(l, m));
                if any {
                    assert!(spec.may_match(m), "{key} {m:?}");
                }
                if !spec.may_match(m) {
                    assert!(!any, "{key} {m:?}");
                }
            }
        }
        let spec = TargetSpec::Names(vec!["q_proj".into()]);
        assert!(spec.may_match(LoraModule::Q) && !spec.may_match(LoraModule::K));
        let re = TargetSpec::Regex(FullMatch::new("t", r".*\.k_proj").unwrap());
        assert!(
            re.may_match(LoraModule::Q),
            "a regex is probed layer by layer"
        );
    }

    #[test]
    fn regex_is_a_full_match() {
        let spec = TargetSpec::Regex(FullMatch::new("t", r".*\.(q_proj|v_proj)").unwrap());
        assert!(spec.matches(5, LoraModule::V) && !spec.matches(5, LoraModule::O));
        let spec = TargetSpec::Regex(
            FullMatch::new("t", r"model\.layers\.[01]\.self_attn\.q_proj").unwrap(),
        );
        assert!(spec.matches(1, LoraModule::Q) && !spec.matches(2, LoraModule::Q));
        assert!(FullMatch::new("t", r"(?<=x)q_proj").is_err());
    }

    #[test]
    fn pattern_lookup_prefers_exact_then_longest_then_regex() {
        let map: BTreeMap<String, usize> = [
            ("q_proj".to_string(), 2),
            ("model.layers.0.self_attn.q_proj".to_string(), 3),
            ("layers.1.self_attn.q_proj".to_string(), 4),
            (r"layers\.[23]\.mlp\.(up|down)_proj".to_string(), 5),
        ]
        .into_iter()
        .collect();
        assert_eq!(pattern_lookup(&map, 0, LoraModule::Q), Some(3));
        assert_eq!(pattern_lookup(&map, 1, LoraModule::Q), Some(4));
        assert_eq!(pattern_lookup(&map, 7, LoraModule::Q), Some(2));
        assert_eq!(pattern_lookup(&map, 3, LoraModule::Up), Some(5));
        assert_eq!(pattern_lookup(&map, 4, LoraModule::Up), None);
        assert_eq!(pattern_lookup(&map, 0, LoraModule::K), None);
    }
}
