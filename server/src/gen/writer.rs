//! Streaming safetensors output, HF-style sharding and HF-style JSON files.
//!
//! Tensors are handed to `safetensors::serialize_to_file` as [`LazyTensor`] views whose
//! bytes are generated only when the writer asks for them, one tensor at a time, so even a
//! 13.5 GB model never sits in memory: the peak is the largest single tensor.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;

use super::init::TensorSpec;

/// transformers' default `max_shard_size` ("5GB", decimal) for `save_pretrained`.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// A tensor whose bytes are generated when the safetensors writer reads them.
pub struct LazyTensor<'a> {
    spec: &'a TensorSpec,
    seed: u64,
}

impl<'a> LazyTensor<'a> {
    pub fn new(spec: &'a TensorSpec, seed: u64) -> Self {
        LazyTensor { spec, seed }
    }
}

impl safetensors::View for LazyTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.spec.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        &self.spec.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.spec.generate(self.seed))
    }

    fn data_len(&self) -> usize {
        self.spec.size_bytes()
    }
}

/// One output file of a (possibly sharded) checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// File name inside the model directory.
    pub file_name: String,
    /// Indices into the tensor list, in the model's parameter order.
    pub tensors: Vec<usize>,
    /// Tensor bytes in this file (header excluded).
    pub bytes: u64,
}

/// How a checkpoint is split into files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub shards: Vec<Shard>,
    /// Sum of all tensor bytes (`metadata.total_size` of the index).
    pub total_bytes: u64,
}

impl ShardPlan {
    /// Splits `tensors` (in parameter order) the way transformers / huggingface_hub do: fill
    /// a shard until the next tensor would overflow `max_shard_bytes`, then start a new one;
    /// a tensor larger than the limit gets a shard of its own. One shard is written as
    /// `{prefix}.safetensors`; several as `{prefix}-0000i-of-0000n.safetensors`.
    pub fn new(prefix: &str, tensors: &[TensorSpec], max_shard_bytes: u64) -> Self {
        let mut groups: Vec<(Vec<usize>, u64)> = Vec::new();
        let mut current: (Vec<usize>, u64) = (Vec::new(), 0);
        for (i, t) in tensors.iter().enumerate() {
            let size = t.size_bytes() as u64;
            if size > max_shard_bytes {
                groups.push((vec![i], size));
                continue;
            }
            if !current.0.is_empty() && current.1 + size > max_shard_bytes {
                groups.push(std::mem::take(&mut current));
            }
            current.0.push(i);
            current.1 += size;
        }
        if !current.0.is_empty() || groups.is_empty() {
            groups.push(current);
        }
        let n = groups.len();
        let shards = groups
            .into_iter()
            .enumerate()
            .map(|(i, (tensors, bytes))| Shard {
                file_name: if n == 1 {
                    format!("{prefix}.safetensors")
                } else {
                    format!("{prefix}-{:05}-of-{n:05}.safetensors", i + 1)
                },
                tensors,
                bytes,
            })
            .collect();
        ShardPlan {
            shards,
            total_bytes: tensors.iter().map(|t| t.size_bytes() as u64).sum(),
        }
    }

    /// The `{prefix}.safetensors.index.json` document, or `None` for a single file.
    pub fn index(&self, tensors: &[TensorSpec]) -> Option<Value> {
        if self.shards.len() < 2 {
            return None;
        }
        let weight_map: BTreeMap<&str, &str> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(move |&i| (tensors[i].name.as_str(), s.file_name.as_str()))
            })
            .collect();
        Some(serde_json::json!({
            "metadata": { "total_size": self.total_bytes },
            "weight_map": weight_map,
        }))
    }
}

/// Writes one safetensors file holding `tensors`, generating each as it is written.
/// The header carries `{"format": "pt"}`, as PyTorch-saved checkpoints do.
pub fn write_safetensors(path: &Path, tensors: &[&TensorSpec], seed: u64) -> anyhow::Result<()> {
    let views = tensors
        .iter()
        .map(|t| (t.name.as_str(), LazyTensor::new(t, seed)));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes every shard of `plan` (and the index when sharded) into `dir`.
pub fn write_checkpoint(
    dir: &Path,
    prefix: &str,
    tensors: &[TensorSpec],
    plan: &ShardPlan,
    seed: u64,
) -> anyhow::Result<()> {
    for shard in &plan.shards {
        let specs: Vec<&TensorSpec> = shard.tensors.iter().map(|&i| &tensors[i]).collect();
        tracing::info!(file = %shard.file_name, tensors = specs.len(), bytes = shard.bytes, "writing shard");
        write_safetensors(&dir.join(&shard.file_name), &specs, seed)?;
    }
    if let Some(index) = plan.index(tensors) {
        write_json(
            &dir.join(format!("{prefix}.safetensors.index.json")),
            &index,
        )?;
    }
    Ok(())
}

/// Writes `value` the way transformers and PEFT write their JSON files: keys sorted,
/// two-space indent, trailing newline. Key order does not depend on serde_json features.
pub fn write_json(path: &Path, value: &Value) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(&Sorted(value))?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Serialises a JSON value with object keys in sorted order.
struct Sorted<'a>(&'a Value);

impl Serialize for Sorted<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::Object(map) => {
                let sorted: BTreeMap<&String, Sorted<'_>> =
                    map.iter().map(|(k, v)| (k, Sorted(v))).collect();
                sorted.serialize(s)
            }
            Value::Array(items) => s.collect_seq(items.iter().map(Sorted)),
            other => other.serialize(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen::init::Init;
    use crate::gen::presets::WeightDtype;

    fn specs(sizes: &[usize]) -> Vec<TensorSpec> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                TensorSpec::new(
                    format!("t{i}"),
                    vec![n],
                    WeightDtype::F32,
                    Init::normal(1.0),
                )
            })
            .collect()
    }

    #[test]
    fn one_shard_is_unindexed() {
        let t = specs(&[10, 20]);
        let plan = ShardPlan::new("model", &t, 1000);
        assert_eq!(plan.shards.len(), 1);
        assert_eq!(plan.shards[0].file_name, "model.safetensors");
        assert!(plan.index(&t).is_none());
    }

    #[test]
    fn shards_fill_greedily_and_oversized_tensors_stand_alone() {
        // Bytes: 40, 40, 40, 400, 40 with a 100-byte limit.
        let t = specs(&[10, 10, 10, 100, 10]);
        let plan = ShardPlan::new("model", &t, 100);
        let groups: Vec<Vec<usize>> = plan.shards.iter().map(|s| s.tensors.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![3], vec![2, 4]]);
        assert_eq!(plan.shards[2].file_name, "model-00003-of-00003.safetensors");
        let index = plan.index(&t).unwrap();
        assert_eq!(index["metadata"]["total_size"], 560);
        assert_eq!(
            index["weight_map"]["t3"],
            "model-00002-of-00003.safetensors"
        );
    }

    #[test]
    fn json_keys_are_sorted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        write_json(&path, &serde_json::json!({"b": 1, "a": {"d": 2, "c": [3]}})).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.find("\"a\"").unwrap() < text.find("\"b\"").unwrap());
        assert!(text.find("\"c\"").unwrap() < text.find("\"d\"").unwrap());
        assert!(text.ends_with("}\n"));
    }
}
