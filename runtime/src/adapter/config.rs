//! `adapter_config.json` as PEFT `save_pretrained` writes it (LoRA only). Fields Thaw does not
//! need are ignored, so configs from newer PEFT versions load; fields that change the math in
//! ways Thaw does not implement are rejected with a reason.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::AdapterError;
use super::module::LoraModule;
use super::targets::{pattern_lookup, FullMatch, TargetSpec};
use crate::model::json::{self, Obj};

/// Layers probed when resolving a regex `target_modules` before the base model is known.
const PROBE_LAYERS: usize = 512;

/// A PEFT LoRA config, reduced to what serving needs.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    /// Default rank (`r`).
    pub r: usize,
    pub lora_alpha: f32,
    /// The projections targeted in at least one layer, in [`LoraModule::ALL`] order.
    pub target_modules: Vec<LoraModule>,
    pub use_rslora: bool,
    pub rank_pattern: BTreeMap<String, usize>,
    pub alpha_pattern: BTreeMap<String, f32>,
    /// Always false after loading: PEFT itself overrides it for `nn.Linear` targets.
    pub fan_in_fan_out: bool,
    pub layers_to_transform: Option<Vec<usize>>,
    pub base_model_name_or_path: Option<String>,
    /// `target_modules` as written, for per-layer matching.
    pub target_spec: TargetSpec,
    pub exclude_modules: Option<TargetSpec>,
}

fn invalid(field: &str, reason: impl Into<String>) -> AdapterError {
    AdapterError::InvalidConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn field<T>(key: &str, r: Result<T, String>) -> Result<T, AdapterError> {
    r.map_err(|reason| invalid(key, reason))
}

fn string_list(key: &str, v: &Value) -> Result<Vec<String>, AdapterError> {
    let items = v.as_array().ok_or_else(|| {
        invalid(
            key,
            format!("expected a list of strings or a string, got {v}"),
        )
    })?;
    items
        .iter()
        .map(|s| {
            s.as_str()
                .map(str::to_string)
                .ok_or_else(|| invalid(key, format!("expected strings, got {s}")))
        })
        .collect()
}

/// A list or a regex string; `None` for null or an empty list.
fn parse_target_spec(key: &str, v: Option<&Value>) -> Result<Option<TargetSpec>, AdapterError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) if s == "all-linear" => Ok(Some(TargetSpec::Names(
            LoraModule::ALL
                .iter()
                .map(|m| m.hf_name().to_string())
                .collect(),
        ))),
        Some(Value::String(s)) => Ok(Some(TargetSpec::Regex(FullMatch::new(key, s)?))),
        Some(v) => {
            let names = string_list(key, v)?;
            Ok((!names.is_empty()).then_some(TargetSpec::Names(names)))
        }
    }
}

/// Modules outside the seven projections that a regex could select (and whose weights Thaw
/// could not apply).
const OTHER_MODULES: [&str; 3] = ["lm_head", "model.embed_tokens", "model.norm"];

/// Checks a target spec only names the seven projections.
fn check_targets(spec: &TargetSpec) -> Result<(), AdapterError> {
    match spec {
        TargetSpec::Names(keys) => {
            for key in keys {
                let last = key.rsplit('.').next().unwrap_or(key);
                let known = LoraModule::from_hf_name(last).is_some_and(|m| {
                    (0..PROBE_LAYERS).any(|l| TargetSpec::Names(vec![key.clone()]).matches(l, m))
                });
                if !known {
                    return Err(AdapterError::UnknownTargetModule(key.clone()));
                }
            }
        }
        TargetSpec::Regex(re) => {
            if let Some(other) = OTHER_MODULES.iter().find(|p| spec.matches_path(p)) {
                return Err(AdapterError::UnknownTargetModule(format!(
                    "{other} (matched by `{}`)",
                    re.source()
                )));
            }
        }
    }
    Ok(())
}

impl AdapterConfig {
    /// Reads `adapter_config.json`.
    pub fn from_file(path: &Path) -> Result<Self, AdapterError> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => AdapterError::MissingFile {
                path: path.to_path_buf(),
            },
            _ => AdapterError::Io {
                path: path.to_path_buf(),
                reason: e.to_string(),
            },
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of an `adapter_config.json`.
    pub fn from_json(s: &str) -> Result<Self, AdapterError> {
        Self::parse(s, Path::new("adapter_config.json"))
    }

    fn parse(text: &str, path: &Path) -> Result<Self, AdapterError> {
        let not_json = |reason: String| AdapterError::ConfigNotJson {
            path: PathBuf::from(path),
            reason,
        };
        let value: Value = serde_json::from_str(text).map_err(|e| not_json(e.to_string()))?;
        let obj = value
            .as_object()
            .ok_or_else(|| not_json("expected a JSON object at the top level".into()))?;
        Self::from_object(obj)
    }

    fn from_object(obj: &Obj) -> Result<Self, AdapterError> {
        reject_unsupported(obj)?;

        let r = field("r", json::get_usize(obj, "r"))?.unwrap_or(8);
        if r == 0 {
            return Err(invalid("r", "must be positive"));
        }
        let lora_alpha = finite_alpha(
            "lora_alpha",
            field("lora_alpha", json::get_f64(obj, "lora_alpha"))?.unwrap_or(8.0),
        )?;
        let target_spec = parse_target_spec("target_modules", json::opt(obj, "target_modules"))?.ok_or_else(|| {
            invalid(
                "target_modules",
                "is missing or empty; list the projections the adapter trains, e.g. [\"q_proj\", \"v_proj\"]",
            )
        })?;
        check_targets(&target_spec)?;
        let exclude_modules =
            parse_target_spec("exclude_modules", json::opt(obj, "exclude_modules"))?;
        let layers_to_transform = json::opt(obj, "layers_to_transform")
            .map(|v| field("layers_to_transform", json::usize_list_of(v)))
            .transpose()?;

        let mut fan_in_fan_out =
            field("fan_in_fan_out", json::get_bool(obj, "fan_in_fan_out"))?.unwrap_or(false);
        if fan_in_fan_out {
            // Same as PEFT for torch.nn.Linear targets: the weights are stored [out, in] anyway.
            tracing::warn!("fan_in_fan_out is set to True but the target modules are nn.Linear; setting it to False");
            fan_in_fan_out = false;
        }

        let mut rank_pattern = BTreeMap::new();
        for (k, v) in json::opt(obj, "rank_pattern")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let rank = field(&format!("rank_pattern.{k}"), json::usize_of(v))?;
            if rank == 0 {
                return Err(invalid(&format!("rank_pattern.{k}"), "must be positive"));
            }
            rank_pattern.insert(k.clone(), rank);
        }
        let mut alpha_pattern = BTreeMap::new();
        for (k, v) in json::opt(obj, "alpha_pattern")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let key = format!("alpha_pattern.{k}");
            alpha_pattern.insert(
                k.clone(),
                finite_alpha(&key, field(&key, json::f64_of(v))?)?,
            );
        }

        let mut config = Self {
            r,
            lora_alpha,
            target_modules: Vec::new(),
            use_rslora: field("use_rslora", json::get_bool(obj, "use_rslora"))?.unwrap_or(false),
            rank_pattern,
            alpha_pattern,
            fan_in_fan_out,
            layers_to_transform,
            base_model_name_or_path: field(
                "base_model_name_or_path",
                json::get_str(obj, "base_model_name_or_path"),
            )?
            .map(str::to_string),
            target_spec,
            exclude_modules,
        };
        let probe: Vec<usize> = match &config.layers_to_transform {
            Some(layers) => layers.clone(),
            None => (0..PROBE_LAYERS).collect(),
        };
        config.target_modules = LoraModule::ALL
            .into_iter()
            .filter(|&m| {
                config.target_spec.may_match(m) && probe.iter().any(|&l| config.targets(l, m))
            })
            .collect();
        if config.target_modules.is_empty() {
            let what = match &config.target_spec {
                TargetSpec::Names(n) => n.join(", "),
                TargetSpec::Regex(re) => re.source().to_string(),
            };
            return Err(AdapterError::UnknownTargetModule(what));
        }
        Ok(config)
    }

    /// Whether the adapter has LoRA weights for projection `m` of `layer`.
    pub fn targets(&self, layer: usize, m: LoraModule) -> bool {
        if self
            .layers_to_transform
            .as_ref()
            .is_some_and(|l| !l.contains(&layer))
        {
            return false;
        }
        if self
            .exclude_modules
            .as_ref()
            .is_some_and(|e| e.matches(layer, m))
        {
            return false;
        }
        self.target_spec.matches(layer, m)
    }

    /// Rank and scale of one (layer, module) after `rank_pattern` / `alpha_pattern`:
    /// scale = alpha / r, or alpha / sqrt(r) with rsLoRA.
    pub fn rank_and_scale(&self, layer: usize, m: LoraModule) -> (usize, f32) {
        let r = pattern_lookup(&self.rank_pattern, layer, m).unwrap_or(self.r);
        let alpha = pattern_lookup(&self.alpha_pattern, layer, m).unwrap_or(self.lora_alpha);
        let denom = if self.use_rslora {
            (r as f32).sqrt()
        } else {
            r as f32
        };
        (r, alpha / denom)
    }
}

/// An alpha as the f32 the kernels scale by; one beyond f32's range would make the scale
/// infinite and every output of the adapter NaN.
fn finite_alpha(key: &str, alpha: f64) -> Result<f32, AdapterError> {
    let a = alpha as f32;
    if a.is_finite() {
        Ok(a)
    } else {
        Err(invalid(
            key,
            format!("is {alpha}, beyond the range of f32 (about ±3.4e38); re-save the adapter"),
        ))
    }
}

/// Config features that change the adapter's math or the base model's weights.
fn reject_unsupported(obj: &Obj) -> Result<(), AdapterError> {
    if let Some(t) = field("peft_type", json::get_str(obj, "peft_type"))? {
        if t != "LORA" {
            return Err(AdapterError::UnsupportedPeftType(t.to_string()));
        }
    }
    if field("use_dora", json::get_bool(obj, "use_dora"))? == Some(true) {
        return Err(AdapterError::Dora);
    }
    if let Some(bias) = field("bias", json::get_str(obj, "bias"))? {
        if bias != "none" {
            return Err(AdapterError::Bias(format!("bias=\"{bias}\"")));
        }
    }
    if field("lora_bias", json::get_bool(obj, "lora_bias"))? == Some(true) {
        return Err(AdapterError::Bias("lora_bias=true".into()));
    }
    if let Some(v) = json::opt(obj, "modules_to_save") {
        let modules = string_list("modules_to_save", v)?;
        if !modules.is_empty() {
            return Err(AdapterError::ModulesToSave(modules));
        }
    }
    let set = |key: &str| match json::opt(obj, key) {
        None | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    let unsupported = [
        ("layer_replication", "duplicates base layers"),
        (
            "target_parameters",
            "targets raw parameters (e.g. MoE experts) rather than projections",
        ),
        ("trainable_token_indices", "trains embedding rows"),
        ("use_qalora", "is QA-LoRA, which pools inputs before lora_A"),
        (
            "alora_invocation_tokens",
            "is an activated LoRA, applied only after invocation tokens",
        ),
    ];
    for (key, what) in unsupported {
        if set(key) {
            return Err(invalid(
                key,
                format!("is set: this adapter {what}, which Thaw does not support"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
