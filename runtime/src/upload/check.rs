//! What a loader thread checks of a layer it reads from an adapter's mapped safetensors file
//! (the disk tier, [`crate::adapter::LoraAdapter::map`]) before the layer counts as encoded,
//! so a layer's copy is queued only once all its bytes were read and found sound: the file is
//! still the one mapped (a truncated mapping faults on a lost page; a replaced file is not the
//! adapter registered), and every weight is finite (a NaN turns every logit of the adapter's
//! requests into NaN). An adapter held in memory, or read in place and verified whole
//! ([`LoraAdapter::verify_in_place`]), was checked when it was read, so its weights are not
//! checked again; a verified mapping is refused only if its file changed in place.
use std::sync::Arc;

use super::layout::Placed;
use crate::adapter::{AdapterError, LoraAdapter, LoraTensor, MappedFile};

/// Checks the factors `placed` lists (one layer's) of `adapter` that are read from a mapped
/// file; the error says what is wrong and what to do. The upload pipeline's loader threads
/// check the files first ([`files_unchanged`]) and the weights as they copy them
/// ([`needs_finite_check`], [`non_finite`]): one pass over the bytes; this is both passes for
/// a layer that is not copied.
pub fn check_layer(adapter: &LoraAdapter, placed: &[Placed]) -> Result<(), String> {
    files_unchanged(adapter, placed)?;
    for p in placed {
        let Some(w) = adapter.get(p.layer, p.module) else {
            continue;
        };
        for (t, factor) in [(&w.a, "lora_A"), (&w.b, "lora_B")] {
            if !needs_finite_check(t) {
                continue;
            }
            if let Some(index) = t.first_non_finite() {
                return Err(non_finite(p, factor, index));
            }
        }
    }
    Ok(())
}

/// Checks that every file the factors `placed` lists are read from is still the one mapped
/// (`stat` only, no page read): run before a layer's bytes are read, since reading a mapping
/// of a file truncated meanwhile faults.
pub fn files_unchanged(adapter: &LoraAdapter, placed: &[Placed]) -> Result<(), String> {
    let mut files: Vec<&Arc<MappedFile>> = Vec::new();
    for p in placed {
        let Some(w) = adapter.get(p.layer, p.module) else {
            continue;
        };
        for t in [&w.a, &w.b] {
            let Some((file, _)) = t.file_range() else {
                continue;
            };
            if !files.iter().any(|f| Arc::ptr_eq(f, file)) {
                unchanged(file, std::fs::metadata(&file.source().path))?;
                files.push(file);
            }
        }
    }
    Ok(())
}

/// Whether `t`'s weights must be checked finite as they are read: read in place from a mapped
/// file that was not verified whole. A verified file's weights were all found finite by the
/// loader's read in place; a factor held in memory was checked when it was read.
pub fn needs_finite_check(t: &LoraTensor) -> bool {
    t.file_range().is_some_and(|(f, _)| !f.is_verified())
}

/// The error of `p`'s `factor` (`lora_A`, `lora_B`) holding a NaN or an infinity at `index`.
pub fn non_finite(p: &Placed, factor: &str, index: usize) -> String {
    let tensor = format!("layer {} {} {factor}", p.layer, p.module);
    AdapterError::NonFinite { tensor, index }.to_string()
}

/// Whether `file`'s mapping can still be read, given what `stat` says of its path now. A
/// mapping that stands in for the loader's read must be of the file at its path (same device,
/// inode and length). A verified one is a full host copy of the bytes it checked: a file
/// removed, or a new one renamed over its path, leaves those bytes mapped (served until the
/// adapter is loaded again, as a heap copy was); only the same file at another length
/// (rewritten in place, which faults a mapping) is refused.
fn unchanged(file: &MappedFile, now: std::io::Result<std::fs::Metadata>) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let src = file.source();
    let same_inode = |m: &std::fs::Metadata| (m.dev(), m.ino()) == (src.dev, src.ino);
    match now {
        Ok(m) if file.is_verified() && !same_inode(&m) => Ok(()),
        Err(_) if file.is_verified() => Ok(()),
        Ok(m) => src.matches(&m),
        Err(e) => Err(format!(
            "reading adapter file {} failed: {e}; restore it and load the adapter again",
            src.path.display()
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{fixtures, ModelConfig};
    use crate::upload::ImageLayout;

    /// The factors of layer `l` of `a`, as the loader thread encoding it lists them.
    pub(in crate::upload) fn layer(a: &LoraAdapter, l: usize) -> Vec<Placed> {
        let layout = ImageLayout::of(a, None);
        layout
            .entries
            .iter()
            .filter(|p| p.layer == l)
            .copied()
            .collect()
    }

    /// A writable copy of the `r4_qv` fixture whose last layer's first factor holds a NaN
    /// (element 1), rewritten in place; returns the copy and the poisoned layer.
    pub(crate) fn poisoned_last_layer(model: &ModelConfig) -> (tempfile::TempDir, usize) {
        let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
        let clean = LoraAdapter::map(dir.path(), model).unwrap();
        let last = clean.num_layers() - 1;
        let p = layer(&clean, last)[0];
        let w = clean.get(p.layer, p.module).unwrap();
        let ((_, range), elem) = (w.a.file_range().unwrap(), w.a.dtype().size());
        drop(clean);
        let path = dir.path().join("adapter_model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        // A quiet NaN in the file's dtype (little-endian).
        let nan: &[u8] = match elem {
            4 => &[0x00, 0x00, 0xc0, 0x7f],
            _ => &[0xc0, 0x7f],
        };
        bytes[range.start + elem..range.start + 2 * elem].copy_from_slice(nan);
        std::fs::write(&path, &bytes).unwrap();
        (dir, last)
    }

    /// A mapped adapter's layer with a NaN fails its check, naming the layer; the layers
    /// before it pass; a file truncated under the mapping fails before any read; an adapter
    /// read into memory is not checked again.
    #[test]
    fn a_mapped_layer_is_checked_before_it_counts_as_encoded() {
        let model = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let clean = LoraAdapter::map(&fixtures::adapter("r4_qv"), &model).unwrap();
        assert!(clean.num_layers() >= 2);
        for l in 0..clean.num_layers() {
            assert_eq!(check_layer(&clean, &layer(&clean, l)), Ok(()));
        }
        let (dir, last) = poisoned_last_layer(&model);
        let bad = LoraAdapter::map(dir.path(), &model).unwrap();
        for l in 0..last {
            assert_eq!(check_layer(&bad, &layer(&bad, l)), Ok(()), "layer {l}");
        }
        let e = check_layer(&bad, &layer(&bad, last)).unwrap_err();
        assert!(
            e.contains(&format!("layer {last}")) && e.contains("NaN"),
            "{e}"
        );
        // Truncated under the mapping: refused from the file's length, no page read.
        let path = dir.path().join("adapter_model.safetensors");
        let len = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len / 2).unwrap();
        let e = check_layer(&bad, &layer(&bad, 0)).unwrap_err();
        assert!(
            e.contains("truncated") && e.contains("reload the adapter"),
            "{e}"
        );
        let owned = LoraAdapter::load(&fixtures::adapter("r4_qv"), &model).unwrap();
        assert_eq!(check_layer(&owned, &layer(&owned, 0)), Ok(()));
    }

    /// A verified mapping is a full host copy: a new file renamed over its path, or the file
    /// removed, leaves its bytes readable (checked again: nothing), while a bare mapping of
    /// the same file is refused; the same file truncated in place is refused either way.
    #[test]
    fn a_verified_mapping_survives_a_replaced_file_not_a_truncated_one() {
        let model = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
        let path = dir.path().join("adapter_model.safetensors");
        let verified = LoraAdapter::load_in_place(dir.path(), &model).unwrap();
        let bare = LoraAdapter::map(dir.path(), &model).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let tmp = dir.path().join("new.tmp");
        std::fs::write(&tmp, &bytes).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert_eq!(check_layer(&verified, &layer(&verified, 0)), Ok(()));
        let e = check_layer(&bare, &layer(&bare, 0)).unwrap_err();
        assert!(e.contains("replaced"), "{e}");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(check_layer(&verified, &layer(&verified, 0)), Ok(()));
        assert!(check_layer(&bare, &layer(&bare, 0)).is_err());

        let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
        let path = dir.path().join("adapter_model.safetensors");
        let verified = LoraAdapter::load_in_place(dir.path(), &model).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len / 2).unwrap();
        let e = check_layer(&verified, &layer(&verified, 0)).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
    }
}
