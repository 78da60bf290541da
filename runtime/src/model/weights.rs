//! The base model's weights: `model.safetensors`, or `model.safetensors.index.json` and its
//! shards, as written by transformers `save_pretrained`. Tensors keep their stored precision
//! (f32/f16/bf16, or ggml blocks for GGUF) until the model builder takes them: matrices stay
//! as stored ([`Weights::take_matrix`]), vectors are widened ([`Weights::take`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use thaw_kernels::cpu::{WeightData, WeightMatrix};

use super::config::read_json;
use super::error::ModelError;
use super::mmap::FileBytes;

/// A dense row-major f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorF32 {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A tensor as stored: its shape and elements in the file's format.
#[derive(Clone, Debug, PartialEq)]
struct Stored {
    shape: Vec<usize>,
    data: WeightData,
}

impl Stored {
    fn into_f32(self) -> Vec<f32> {
        match self.data {
            WeightData::F32(v) => v.into_vec(),
            data => {
                let cols = self.shape.last().copied().unwrap_or(1);
                let rows = self.shape.iter().product::<usize>() / cols.max(1);
                WeightMatrix::from_data(data, rows, cols)
                    .expect("lengths were checked when the tensor was added")
                    .to_f32()
            }
        }
    }
}

/// All tensors of a checkpoint by HF name; the model builder [`take`](Weights::take)s them out.
#[derive(Debug, Default)]
pub struct Weights {
    tensors: HashMap<String, Stored>,
}

/// f16/bf16 tensor bytes kept as they are (`None` for other dtypes).
fn view_to_half(view: &TensorView<'_>) -> Option<WeightData> {
    let halves = || {
        view.data()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    match view.dtype() {
        Dtype::F16 => Some(WeightData::F16(
            halves().map(half::f16::from_bits).collect(),
        )),
        Dtype::BF16 => Some(WeightData::BF16(
            halves().map(half::bf16::from_bits).collect(),
        )),
        _ => None,
    }
}

/// Widens F32/F16/BF16 tensor bytes (little-endian, as safetensors stores them) to f32.
/// Returns the dtype back when it is not one of those.
pub(crate) fn view_to_f32(view: &TensorView<'_>) -> Result<Vec<f32>, Dtype> {
    let bytes = view.data();
    let fast = match view.dtype() {
        Dtype::F32 => widen(bytes, |x: f32| x),
        Dtype::F16 => widen(bytes, half::f16::to_f32),
        Dtype::BF16 => widen(bytes, half::bf16::to_f32),
        other => return Err(other),
    };
    Ok(fast.unwrap_or_else(|| {
        // Unaligned payload (or a big-endian host): decode byte by byte.
        use thaw_kernels::cpu::{bytes_to_f32, FloatFormat};
        let format = match view.dtype() {
            Dtype::F16 => FloatFormat::F16,
            Dtype::BF16 => FloatFormat::BF16,
            _ => FloatFormat::F32,
        };
        let n = bytes.len() / format.size();
        let mut v = super::mmap::committed_vec(n);
        v.resize(n, 0.0);
        bytes_to_f32(format, &bytes[..n * format.size()], &mut v)
            .expect("the length is a whole number of elements");
        v
    }))
}

/// Widens an aligned little-endian payload of `T` in one pass into committed memory (a plain
/// copy for f32); `None` when the bytes cannot be viewed as `T` in place.
fn widen<T: bytemuck::Pod>(bytes: &[u8], f: impl Fn(T) -> f32) -> Option<Vec<f32>> {
    if cfg!(target_endian = "big") {
        return None;
    }
    let s = bytemuck::try_cast_slice::<u8, T>(bytes).ok()?;
    let mut v = super::mmap::committed_vec(s.len());
    v.extend(s.iter().map(|&x| f(x)));
    Some(v)
}

impl Weights {
    /// Loads `model.safetensors`, or `model.safetensors.index.json` plus the shards it names.
    /// F32/F16/BF16 tensors are converted to f32; any other dtype is
    /// [`ModelError::UnsupportedDtype`].
    pub fn load_dir(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut weights = Self::default();
        if index.is_file() {
            for (shard, names) in shard_map(&index)? {
                let path = dir.join(&shard);
                if !path.is_file() {
                    return Err(ModelError::MissingFile {
                        path,
                        hint: format!(
                            "{} names this shard; download the complete checkpoint",
                            index.display()
                        ),
                    });
                }
                weights.load_file(&path)?;
                if let Some(missing) = names.iter().find(|n| !weights.contains(n)) {
                    return Err(ModelError::Safetensors {
                        path,
                        reason: format!(
                            "the index places `{missing}` in this shard but it is not there"
                        ),
                    });
                }
            }
        } else if single.is_file() {
            weights.load_file(&single)?;
        } else {
            let hint = if dir.join("pytorch_model.bin").is_file()
                || dir.join("pytorch_model.bin.index.json").is_file()
            {
                "only pytorch_model.bin was found; Thaw reads safetensors only — re-save with \
                 `model.save_pretrained(dir, safe_serialization=True)`"
            } else {
                "expected model.safetensors or model.safetensors.index.json as written by \
                 transformers `save_pretrained`"
            };
            return Err(ModelError::MissingFile {
                path: single,
                hint: hint.to_string(),
            });
        }
        Ok(weights)
    }

    /// Adds every tensor of one safetensors file.
    fn load_file(&mut self, path: &Path) -> Result<(), ModelError> {
        let bytes = FileBytes::open(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        for (name, view) in st.iter() {
            // Matrices in f16/bf16 stay half precision (decode reads half the bytes); the
            // CPU kernels accumulate in f32.
            let data = match view_to_half(&view) {
                Some(d) if view.shape().len() == 2 => d,
                _ => WeightData::F32(
                    view_to_f32(&view)
                        .map_err(|dtype| ModelError::UnsupportedDtype {
                            tensor: name.to_string(),
                            dtype: format!("{dtype:?}"),
                        })?
                        .into(),
                ),
            };
            let tensor = Stored {
                shape: view.shape().to_vec(),
                data,
            };
            if self.tensors.insert(name.to_string(), tensor).is_some() {
                return Err(ModelError::DuplicateTensor {
                    tensor: name.to_string(),
                    path: path.to_path_buf(),
                });
            }
        }
        Ok(())
    }

    /// Builds a set of weights from tensors already in memory (tests, synthetic models).
    pub fn from_tensors(tensors: HashMap<String, TensorF32>) -> Self {
        let tensors = tensors
            .into_iter()
            .map(|(n, t)| {
                let s = Stored {
                    shape: t.shape,
                    data: WeightData::F32(t.data.into()),
                };
                (n, s)
            })
            .collect();
        Self { tensors }
    }

    /// Adds a tensor in its stored format (`shape` row-major, HF order), checking that `data`
    /// holds exactly that many elements. Returns false when `name` was already present.
    pub fn insert(
        &mut self,
        name: String,
        shape: Vec<usize>,
        data: WeightData,
    ) -> Result<bool, ModelError> {
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let rows = rows.map_or(usize::MAX, |n| n / cols.max(1));
        let data = WeightMatrix::from_data(data, rows, cols)
            .map_err(|e| ModelError::BadTensor {
                tensor: name.clone(),
                reason: format!("shape {shape:?}: {e}"),
            })?
            .data()
            .clone();
        Ok(self.tensors.insert(name, Stored { shape, data }).is_none())
    }

    /// Removes and returns tensor `name` widened to f32, checking its shape.
    pub fn take(&mut self, name: &str, expected_shape: &[usize]) -> Result<TensorF32, ModelError> {
        self.check(name, expected_shape)?;
        let t = self.tensors.remove(name).expect("checked present above");
        Ok(TensorF32 {
            shape: t.shape.clone(),
            data: t.into_f32(),
        })
    }

    /// Removes and returns the `[rows, cols]` matrix `name` in its stored format.
    pub fn take_matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<WeightMatrix, ModelError> {
        self.check(name, &[rows, cols])?;
        let t = self.tensors.remove(name).expect("checked present above");
        Ok(WeightMatrix::from_data(t.data, rows, cols)
            .expect("lengths were checked when the tensor was added"))
    }

    /// The stored format of tensor `name`.
    pub fn format(&self, name: &str) -> Option<thaw_kernels::cpu::WeightFormat> {
        self.tensors.get(name).map(|t| match &t.data {
            WeightData::F32(_) => thaw_kernels::cpu::WeightFormat::F32,
            WeightData::F16(_) => thaw_kernels::cpu::WeightFormat::F16,
            WeightData::BF16(_) => thaw_kernels::cpu::WeightFormat::BF16,
            WeightData::Quant(f, _) => *f,
        })
    }

    fn check(&self, name: &str, expected_shape: &[usize]) -> Result<(), ModelError> {
        let got = match self.tensors.get(name) {
            None => {
                return Err(ModelError::MissingTensor {
                    tensor: name.to_string(),
                })
            }
            Some(t) => &t.shape,
        };
        if got != expected_shape {
            return Err(ModelError::ShapeMismatch {
                tensor: name.to_string(),
                expected: expected_shape.to_vec(),
                got: got.clone(),
            });
        }
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of the tensors not yet taken, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

/// `weight_map` of a sharded index, grouped by shard file.
fn shard_map(index: &Path) -> Result<BTreeMap<String, BTreeSet<String>>, ModelError> {
    let bad = |reason: &str| ModelError::Json {
        path: index.to_path_buf(),
        reason: reason.to_string(),
    };
    let value = read_json(index, "")?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("missing the `weight_map` object"))?;
    let mut shards: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad("`weight_map` values must be file names"))?;
        if Path::new(file).components().count() != 1 || file == ".." {
            return Err(bad(&format!(
                "shard `{file}` must be a plain file name in the model directory"
            )));
        }
        shards
            .entry(file.to_string())
            .or_default()
            .insert(name.clone());
    }
    Ok(shards)
}

#[cfg(test)]
#[path = "weights_tests.rs"]
mod tests;
