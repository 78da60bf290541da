//! `adapter_model.safetensors` as PEFT `save_pretrained` writes it, validated against the base
//! model: tensor `base_model.model.model.layers.{i}.{self_attn|mlp}.{x}_proj.lora_{A|B}.weight`,
//! A `[r, d_in]`, B `[d_out, r]`, in F32/F16/BF16, kept in that dtype ([`LoraTensor`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

use super::config::AdapterConfig;
use super::error::AdapterError;
use super::module::LoraModule;
use super::tensor::{LoraTensor, WeightDtype};
use crate::model::ModelConfig;

/// The LoRA factors of one projection of one layer: delta(x) = scale * B (A x).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraWeights {
    pub rank: usize,
    pub scale: f32,
    /// `[rank, d_in]`, row-major, in the stored dtype.
    pub a: LoraTensor,
    /// `[d_out, rank]`, row-major, in the stored dtype.
    pub b: LoraTensor,
}

impl LoraWeights {
    /// Bytes of both factors as stored.
    pub fn bytes(&self) -> usize {
        self.a.bytes().len() + self.b.bytes().len()
    }
}

/// A validated LoRA adapter in host memory, each factor in the dtype its file stores (or the
/// one it was converted to once, see [`LoraAdapter::into_dtype`]).
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub config: AdapterConfig,
    layers: Vec<[Option<LoraWeights>; 7]>,
    targets: Vec<LoraModule>,
}

/// Which factor a tensor holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Factor {
    A,
    B,
}

/// Parses a PEFT LoRA tensor name into (layer, module, factor). Accepts the names with and
/// without the `base_model.model.` prefix and with a `.default` adapter-name infix.
fn parse_name(name: &str) -> Option<(usize, LoraModule, Factor)> {
    let rest = name.strip_prefix("base_model.model.").unwrap_or(name);
    let rest = rest.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let mut parts = rest.split('.');
    let parent = parts.next()?;
    let module = LoraModule::from_hf_name(parts.next()?)?;
    let factor = match parts.next()? {
        "lora_A" => Factor::A,
        "lora_B" => Factor::B,
        _ => return None,
    };
    let tail: Vec<&str> = parts.collect();
    if parent != module.parent() || !(tail == ["weight"] || tail == ["default", "weight"]) {
        return None;
    }
    Some((layer, module, factor))
}

pub(super) fn unexpected(tensor: &str, reason: impl Into<String>) -> AdapterError {
    AdapterError::UnexpectedTensor {
        tensor: tensor.to_string(),
        reason: reason.into(),
    }
}

/// The tensor name PEFT writes for (layer, module, factor), for error messages.
fn canonical_name(layer: usize, m: LoraModule, f: Factor) -> String {
    let f = if f == Factor::A { "lora_A" } else { "lora_B" };
    format!("base_model.model.{}.{f}.weight", m.module_path(layer))
}

impl LoraAdapter {
    /// Loads a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) and
    /// validates it against the base model.
    pub fn load(dir: &Path, model: &ModelConfig) -> Result<Self, AdapterError> {
        Self::load_with(dir, model, 1)
    }

    /// [`Self::load`] reading the safetensors file in up to `threads` parts at once (parts of
    /// at least 16 MiB): the file is read once, whole, into one buffer that its tensors are
    /// ranges of ([`Self::from_file_bytes`]), in the dtype it stores — no copy per tensor, no
    /// conversion.
    pub fn load_with(
        dir: &Path,
        model: &ModelConfig,
        threads: usize,
    ) -> Result<Self, AdapterError> {
        let (config, path) = open_dir(dir)?;
        let bytes = read_whole(&path, threads).map_err(|e| AdapterError::Io {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Self::from_file_bytes(config, bytes, &path, model)
    }

    /// Builds an adapter from the bytes of its safetensors file (`path` names it in errors),
    /// validated like [`Self::from_parts`]; each factor is a range of `bytes`, which it keeps
    /// (freed with the last factor), so nothing is copied.
    pub fn from_file_bytes(
        config: AdapterConfig,
        bytes: Vec<u8>,
        path: &Path,
        model: &ModelConfig,
    ) -> Result<Self, AdapterError> {
        super::in_place::count_copied(bytes.len());
        let bytes = Arc::new(bytes);
        let tensors = SafeTensors::deserialize(&bytes).map_err(|e| AdapterError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let base = bytes.as_ptr() as usize;
        Self::build(config, &tensors, model, |name, view| {
            let dtype = stored_dtype(name, view)?;
            let start = view.data().as_ptr() as usize - base;
            let t = LoraTensor::shared(dtype, &bytes, start..start + view.data().len())
                .ok_or_else(|| {
                    unexpected(name, "its byte length is not a whole number of elements")
                })?;
            finite(name, t)
        })
    }

    /// Builds an adapter from a parsed config and safetensors file, validating every tensor
    /// name, shape, rank and dtype against the config and the base model.
    pub fn from_parts(
        config: AdapterConfig,
        tensors: &SafeTensors<'_>,
        model: &ModelConfig,
    ) -> Result<Self, AdapterError> {
        Self::build(config, tensors, model, stored)
    }

    /// [`LoraAdapter::from_parts`] with `keep` making each validated factor's tensor (a copy,
    /// or a view of the mapped file).
    pub(super) fn build(
        config: AdapterConfig,
        tensors: &SafeTensors<'_>,
        model: &ModelConfig,
        keep: impl Fn(&str, &TensorView<'_>) -> Result<LoraTensor, AdapterError>,
    ) -> Result<Self, AdapterError> {
        let mut found: BTreeMap<(usize, LoraModule, Factor), (String, TensorView<'_>)> =
            BTreeMap::new();
        for (name, view) in tensors.iter() {
            let Some((layer, m, f)) = parse_name(name) else {
                return Err(unexpected(
                    name,
                    "only lora_A/lora_B weights of q/k/v/o/gate/up/down_proj are supported \
                     (no embedding LoRA, DoRA magnitudes, biases or saved modules)",
                ));
            };
            if layer >= model.num_layers {
                return Err(AdapterError::LayerOutOfRange {
                    tensor: name.to_string(),
                    layer,
                    num_layers: model.num_layers,
                });
            }
            if !config.targets(layer, m) {
                return Err(unexpected(
                    name,
                    "adapter_config.json (target_modules / layers_to_transform / exclude_modules) \
                     does not target this module; the config and weights do not belong together",
                ));
            }
            if found
                .insert((layer, m, f), (name.to_string(), view))
                .is_some()
            {
                return Err(unexpected(
                    name,
                    "it appears twice (with and without the `.default` infix)",
                ));
            }
        }

        let mut layers: Vec<[Option<LoraWeights>; 7]> =
            (0..model.num_layers).map(|_| Default::default()).collect();
        for (layer, slots) in layers.iter_mut().enumerate() {
            for m in LoraModule::ALL {
                if !config.targets(layer, m) {
                    continue;
                }
                let (rank, scale) = config.rank_and_scale(layer, m);
                let (d_in, d_out) = model.module_shape(m);
                let get = |f: Factor| {
                    found
                        .get(&(layer, m, f))
                        .ok_or_else(|| AdapterError::MissingTensor {
                            tensor: canonical_name(layer, m, f),
                        })
                };
                let (a_name, a) = get(Factor::A)?;
                let (b_name, b) = get(Factor::B)?;
                check_shape(a_name, a.shape(), [rank, d_in], 0, rank)?;
                check_shape(b_name, b.shape(), [d_out, rank], 1, rank)?;
                slots[m.index()] = Some(LoraWeights {
                    rank,
                    scale,
                    a: keep(a_name, a)?,
                    b: keep(b_name, b)?,
                });
            }
        }
        let targets = LoraModule::ALL
            .into_iter()
            .filter(|m| layers.iter().any(|l| l[m.index()].is_some()))
            .collect();
        Ok(Self {
            config,
            layers,
            targets,
        })
    }

    /// The factors for (layer, module), or `None` where the adapter does not touch it.
    pub fn get(&self, layer: usize, m: LoraModule) -> Option<&LoraWeights> {
        self.layers.get(layer)?[m.index()].as_ref()
    }

    /// Largest rank over all layers and modules (0 for an empty adapter).
    pub fn max_rank(&self) -> usize {
        self.iter().map(|(_, _, w)| w.rank).max().unwrap_or(0)
    }

    /// Number of base-model layers (including ones the adapter does not touch).
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Projections the adapter has weights for in at least one layer, in `LoraModule::ALL` order.
    pub fn targets(&self) -> &[LoraModule] {
        &self.targets
    }

    /// Bytes the A and B factors take as stored: what the host tier, the copy and the device
    /// pages hold (2 a weight for a bf16 adapter).
    pub fn size_bytes(&self) -> usize {
        self.iter().map(|(_, _, w)| w.bytes()).sum()
    }

    /// The dtype of the factors (the first one's; a file mixing dtypes is kept as it is, and
    /// [`LoraAdapter::into_dtype`] makes it uniform). F32 for an empty adapter.
    pub fn dtype(&self) -> WeightDtype {
        self.iter()
            .next()
            .map_or(WeightDtype::F32, |(_, _, w)| w.a.dtype())
    }

    /// Every factor stored in `to`: done once on a loader thread for a backend that computes
    /// from one dtype only (the CUDA kernels read the backend's weight dtype), so nothing is
    /// converted per load on the engine thread. A no-op where every factor is in `to`.
    pub fn into_dtype(mut self, to: WeightDtype) -> Self {
        for slots in &mut self.layers {
            for w in slots.iter_mut().flatten() {
                if w.a.dtype() != to {
                    w.a = w.a.converted(to);
                }
                if w.b.dtype() != to {
                    w.b = w.b.converted(to);
                }
            }
        }
        self
    }

    /// Every (layer, module, weights) present, layer-major.
    pub fn iter(&self) -> impl Iterator<Item = (usize, LoraModule, &LoraWeights)> {
        self.layers.iter().enumerate().flat_map(|(l, slots)| {
            LoraModule::ALL
                .into_iter()
                .filter_map(move |m| slots[m.index()].as_ref().map(|w| (l, m, w)))
        })
    }
}

/// The adapter directory's parsed config and the path of its safetensors file, or what is
/// missing.
pub(super) fn open_dir(dir: &Path) -> Result<(AdapterConfig, std::path::PathBuf), AdapterError> {
    if !dir.is_dir() {
        return Err(AdapterError::NotFound {
            path: dir.to_path_buf(),
        });
    }
    let config = AdapterConfig::from_file(&dir.join("adapter_config.json"))?;
    let path = dir.join("adapter_model.safetensors");
    if !path.is_file() {
        let bin = dir.join("adapter_model.bin");
        return Err(if bin.is_file() {
            AdapterError::PickleWeights { path: bin }
        } else {
            AdapterError::MissingFile { path }
        });
    }
    Ok((config, path))
}

/// Checks a 2-D factor's shape; `rank_axis` is where the rank sits (0 for A, 1 for B).
fn check_shape(
    tensor: &str,
    got: &[usize],
    expected: [usize; 2],
    rank_axis: usize,
    rank: usize,
) -> Result<(), AdapterError> {
    let mismatch = || AdapterError::ShapeMismatch {
        tensor: tensor.to_string(),
        expected: expected.to_vec(),
        got: got.to_vec(),
    };
    if got.len() != 2 {
        return Err(mismatch());
    }
    let model_axis = 1 - rank_axis;
    if got[model_axis] != expected[model_axis] {
        return Err(mismatch());
    }
    if got[rank_axis] != rank {
        return Err(AdapterError::RankMismatch {
            tensor: tensor.to_string(),
            config_rank: rank,
            file_rank: got[rank_axis],
        });
    }
    Ok(())
}

/// The dtype a factor is stored in, if one the kernels read.
pub(super) fn stored_dtype(name: &str, view: &TensorView<'_>) -> Result<WeightDtype, AdapterError> {
    match view.dtype() {
        safetensors::Dtype::F32 => Ok(WeightDtype::F32),
        safetensors::Dtype::F16 => Ok(WeightDtype::F16),
        safetensors::Dtype::BF16 => Ok(WeightDtype::Bf16),
        other => Err(AdapterError::UnsupportedDtype {
            tensor: name.to_string(),
            dtype: format!("{other:?}"),
        }),
    }
}

/// The tensor's bytes in its stored dtype, copied; NaN or infinite weights are refused.
pub(super) fn stored(name: &str, view: &TensorView<'_>) -> Result<LoraTensor, AdapterError> {
    let dtype = stored_dtype(name, view)?;
    let t = LoraTensor::from_le_bytes(dtype, view.data().to_vec())
        .ok_or_else(|| unexpected(name, "its byte length is not a whole number of elements"))?;
    finite(name, t)
}

/// `t` if every weight is finite: a NaN or infinite one would turn every logit of every
/// request on the adapter into NaN.
fn finite(name: &str, t: LoraTensor) -> Result<LoraTensor, AdapterError> {
    match t.first_non_finite() {
        Some(index) => Err(AdapterError::NonFinite {
            tensor: name.to_string(),
            index,
        }),
        None => Ok(t),
    }
}

/// The whole file at `path`, read in up to `threads` parts at once (each of at least 16 MiB)
/// into one buffer. A large buffer starts as untouched zero pages, so the kernel commits each
/// page as the read fills it: no page is written twice.
fn read_whole(path: &Path, threads: usize) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    const MIN_PART: usize = 16 << 20;
    let file = std::fs::File::open(path)?;
    let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
    let mut buf = vec![0u8; len];
    let part = len
        .div_ceil(threads.clamp(1, len.div_ceil(MIN_PART).max(1)))
        .max(1);
    std::thread::scope(|s| {
        let mut parts = buf.chunks_mut(part).enumerate();
        let first = parts.next();
        let file = &file;
        let rest: Vec<_> = parts
            .map(|(i, p)| s.spawn(move || file.read_exact_at(p, (i * part) as u64)))
            .collect();
        let mut r = first.map_or(Ok(()), |(_, p)| file.read_exact_at(p, 0));
        for h in rest {
            let done = h
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a reader thread panicked")));
            r = r.and(done);
        }
        r
    })?;
    Ok(buf)
}

#[cfg(test)]
#[path = "format_tests.rs"]
mod tests;
