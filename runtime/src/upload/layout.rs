//! Where each factor of an adapter sits in its device image (one allocation): factors layer
//! by layer, layer 0 first, each 256-byte aligned, so one contiguous copy moves a layer. The
//! arena holds the same image, so the loader threads write it once and the copy moves it as is.
//! Computing it is O(layers × modules), never O(bytes): cheap enough for the engine thread.
use std::ops::Range;

use crate::adapter::{LoraAdapter, LoraModule, WeightDtype};

fn align(x: usize) -> usize {
    x.next_multiple_of(256)
}

/// One (layer, module) pair of factors in an adapter's image.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Placed {
    pub layer: usize,
    pub module: LoraModule,
    pub rank: u32,
    pub scale: f32,
    /// Byte offsets of A and B.
    pub a_off: usize,
    pub b_off: usize,
    pub b_len: usize,
}

/// An adapter's image: every factor's place, and each layer's byte range.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageLayout {
    pub entries: Vec<Placed>,
    /// Bytes of the whole image (at least 256, so every image has an address of its own).
    pub total: usize,
    pub n_layers: usize,
}

impl ImageLayout {
    /// Places `factors` — (layer, module, rank, scale, A bytes, B bytes), layer-major — in
    /// order.
    pub fn new(
        n_layers: usize,
        factors: impl Iterator<Item = (usize, LoraModule, u32, f32, usize, usize)>,
    ) -> Self {
        let mut entries = Vec::new();
        let mut off = 0;
        for (layer, m, rank, scale, a_len, b_len) in factors {
            let a_off = off;
            let b_off = align(a_off + a_len);
            off = align(b_off + b_len);
            entries.push(Placed {
                layer,
                module: m,
                rank,
                scale,
                a_off,
                b_off,
                b_len,
            });
        }
        Self {
            entries,
            total: off.max(256),
            n_layers,
        }
    }

    /// The image of `adapter` with every factor in `dtype` (`None`: as stored).
    pub fn of(adapter: &LoraAdapter, dtype: Option<WeightDtype>) -> Self {
        let bytes = |t: &crate::adapter::LoraTensor| match dtype {
            Some(d) => t.numel() * d.size(),
            None => t.bytes().len(),
        };
        Self::new(
            adapter.num_layers(),
            adapter
                .iter()
                .map(|(l, m, w)| (l, m, w.rank as u32, w.scale, bytes(&w.a), bytes(&w.b))),
        )
    }

    /// Bytes of layer `l`'s factors: `start..end` in the image (empty if it has none).
    pub fn layer_range(&self, l: usize) -> Range<usize> {
        let mut it = self.entries.iter().filter(|e| e.layer == l);
        let Some(first) = it.next() else {
            return 0..0;
        };
        let last = it.next_back().unwrap_or(first);
        first.a_off..last.b_off + last.b_len
    }

    /// Every layer's range, layer 0 first.
    pub fn layer_ranges(&self) -> Vec<Range<usize>> {
        let mut out = vec![0..0; self.n_layers];
        for e in &self.entries {
            let r = &mut out[e.layer];
            if r.start == r.end {
                *r = e.a_off..e.b_off + e.b_len;
            } else {
                r.end = e.b_off + e.b_len;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{fixtures, ModelConfig};

    /// Layers are contiguous, ordered, aligned and hold exactly their factors' bytes; the
    /// image of a bf16 copy is half the size of the f32 one (plus alignment).
    #[test]
    fn layers_are_ordered_aligned_runs_of_their_factors() {
        let c = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let a = crate::adapter::LoraAdapter::load(&fixtures::adapter("r8_all_rslora"), &c).unwrap();
        let img = ImageLayout::of(&a, None);
        let ranges = img.layer_ranges();
        assert_eq!(ranges.len(), a.num_layers());
        for (l, r) in ranges.iter().enumerate() {
            assert_eq!(*r, img.layer_range(l));
            assert_eq!(r.start % 256, 0);
            if l > 0 {
                assert!(ranges[l - 1].end <= r.start);
            }
        }
        let stored: usize = a.size_bytes();
        assert!(img.total >= stored && img.total < stored + 2 * 256 * img.entries.len());
        let half = ImageLayout::of(&a, Some(WeightDtype::Bf16));
        for (p, q) in half.entries.iter().zip(&img.entries) {
            assert_eq!(2 * p.b_len, q.b_len);
        }
    }
}
