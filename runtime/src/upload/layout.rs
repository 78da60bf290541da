//! Where each factor of an adapter sits in its device image (one allocation): factors layer
//! by layer, layer 0 first, each 256-byte aligned, so one contiguous copy moves a layer. The
//! arena holds the same image, so the loader threads write it once and the copy moves it as is.
//! Computing it is O(layers × modules), never O(bytes): cheap enough for the engine thread.
use std::ops::Range;

use crate::adapter::{LoraAdapter, LoraModule, WeightDtype};

fn align(x: usize) -> usize {
    x.next_multiple_of(256)
}

/// One factor pair to place: (layer, module, rank, scale, A bytes, B bytes).
pub type Factor = (usize, LoraModule, u32, f32, usize, usize);

/// `adapter`'s factors as (layer, module, rank, scale, A bytes, B bytes), layer-major, with
/// every factor in `dtype` (`None`: as stored).
fn factors(adapter: &LoraAdapter, dtype: Option<WeightDtype>) -> impl Iterator<Item = Factor> + '_ {
    let bytes = move |t: &crate::adapter::LoraTensor| match dtype {
        Some(d) => t.numel() * d.size(),
        None => t.bytes().len(),
    };
    adapter
        .iter()
        .map(move |(l, m, w)| (l, m, w.rank as u32, w.scale, bytes(&w.a), bytes(&w.b)))
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
        Self::new(adapter.num_layers(), factors(adapter, dtype))
    }

    /// The image placed in pages of the device budget: a run of pages gives an adapter, in
    /// each layer's K and V buffers, one contiguous region of `region_len` bytes (the run's
    /// blocks); layer `l`'s factors go to regions `2l` (its K range) and `2l + 1` (V), none
    /// straddling a region's end. Offsets are in the virtual image of the `2 × n_layers`
    /// regions end to end (region `r` at `r × region_len`), which the copy maps to the
    /// regions' device addresses. `None` if a layer's factors do not fit in its two regions,
    /// or `region_len` is not a multiple of 256 (region starts must stay aligned).
    pub fn paged(
        n_layers: usize,
        factors: impl Iterator<Item = Factor>,
        region_len: usize,
    ) -> Option<Self> {
        if region_len == 0 || !region_len.is_multiple_of(256) {
            return None;
        }
        let mut entries = Vec::new();
        let (mut region, mut at, mut layer_seen) = (0usize, 0usize, None);
        // Puts `len` bytes in the current region of the layer, or its next one.
        let place = |len: usize, region: &mut usize, at: &mut usize| {
            if *at + len > region_len {
                if *region % 2 == 1 || len > region_len {
                    return None;
                }
                *region += 1;
                *at = 0;
            }
            let off = *region * region_len + *at;
            *at = align(*at + len);
            Some(off)
        };
        for (layer, m, rank, scale, a_len, b_len) in factors {
            if layer_seen != Some(layer) {
                if layer_seen.is_some_and(|l| layer <= l) || layer >= n_layers {
                    return None;
                }
                layer_seen = Some(layer);
                region = 2 * layer;
                at = 0;
            }
            let a_off = place(a_len, &mut region, &mut at)?;
            let b_off = place(b_len, &mut region, &mut at)?;
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
        Some(Self {
            entries,
            total: (2 * n_layers * region_len).max(256),
            n_layers,
        })
    }

    /// The fewest pages whose blocks of `chunk` bytes (one layer's K or V block) hold the
    /// paged image of `factors` (see [`ImageLayout::paged`]), with that image; `None` if no
    /// number does (a `chunk` not a multiple of 256, or malformed factors). O(layers ×
    /// modules × log): cheap enough for the engine thread.
    pub fn pages_needed(
        n_layers: usize,
        factors: &[Factor],
        chunk: usize,
    ) -> Option<(usize, Self)> {
        if chunk == 0 || !chunk.is_multiple_of(256) {
            return None;
        }
        // The largest layer, split evenly over its two regions, is a lower bound; one factor
        // per region more than the aligned bytes is an upper bound.
        let mut per_layer = vec![0usize; n_layers];
        let mut largest = 0;
        for &(l, _, _, _, a, b) in factors {
            *per_layer.get_mut(l)? += align(a) + align(b);
            largest = largest.max(align(a)).max(align(b));
        }
        let top = per_layer.iter().copied().max().unwrap_or(0);
        let mut lo = top.div_ceil(2 * chunk).max(1);
        let mut hi = (top + 2 * largest).div_ceil(chunk).max(lo);
        let fits = |n: usize| Self::paged(n_layers, factors.iter().copied(), n * chunk);
        fits(hi)?;
        // The smallest n that fits (fitting is monotone in n: a larger region holds any
        // placement a smaller one does).
        while lo < hi {
            let mid = (lo + hi) / 2;
            if fits(mid).is_some() {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some((lo, fits(lo)?))
    }

    /// [`ImageLayout::pages_needed`] for `adapter` with every factor in `dtype`.
    pub fn of_paged(
        adapter: &LoraAdapter,
        dtype: Option<WeightDtype>,
        chunk: usize,
    ) -> Option<(usize, Self)> {
        let all: Vec<Factor> = factors(adapter, dtype).collect();
        Self::pages_needed(adapter.num_layers(), &all, chunk)
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

/// The pieces of the image range `off..off + len` that lie in one region each, as (offset in
/// the image, length): a copy never crosses a region's end. One piece for an own allocation
/// (`region_len` 0).
pub fn region_pieces(off: usize, len: usize, region_len: usize) -> Vec<(usize, usize)> {
    if region_len == 0 {
        return vec![(off, len)];
    }
    let mut out = Vec::new();
    let (mut at, end) = (off, off + len);
    while at < end {
        let stop = ((at / region_len + 1) * region_len).min(end);
        out.push((at, stop - at));
        at = stop;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{fixtures, ModelConfig};
    use proptest::prelude::*;

    fn factor_lists() -> impl Strategy<Value = (usize, Vec<Factor>)> {
        (1usize..5).prop_flat_map(|layers| {
            let per = proptest::collection::vec(
                proptest::collection::vec((1usize..6000, 1usize..6000), 0..7),
                layers,
            );
            per.prop_map(move |per| {
                let mut out = Vec::new();
                for (l, fs) in per.into_iter().enumerate() {
                    for (i, (a, b)) in fs.into_iter().enumerate() {
                        out.push((l, LoraModule::ALL[i], 8, 2.0, a, b));
                    }
                }
                (layers, out)
            })
        })
    }

    proptest! {
        /// The fewest pages: the paged image fits in `n` pages and not in `n - 1`; every factor
        /// lies inside one of its own layer's two regions, aligned, without straddling a
        /// region's end or overlapping another factor, and its bytes match.
        #[test]
        fn paged_images_are_minimal_and_stay_in_their_regions(
            (layers, fs) in factor_lists(),
            chunk_blocks in 1usize..40,
        ) {
            let chunk = 256 * chunk_blocks;
            let (n, img) = ImageLayout::pages_needed(layers, &fs, chunk).unwrap();
            let region = n * chunk;
            prop_assert_eq!(img.total, (2 * layers * region).max(256));
            if n > 1 {
                let smaller = ImageLayout::paged(layers, fs.iter().copied(), (n - 1) * chunk);
                prop_assert!(smaller.is_none(), "{} pages fit too", n - 1);
            }
            let mut spans: Vec<(usize, usize)> = Vec::new();
            for (p, f) in img.entries.iter().zip(&fs) {
                prop_assert_eq!((p.layer, p.module), (f.0, f.1));
                prop_assert_eq!(p.b_len, f.5);
                for (off, len) in [(p.a_off, f.4), (p.b_off, f.5)] {
                    prop_assert_eq!(off % 256, 0);
                    let r = off / region;
                    prop_assert!(r == 2 * p.layer || r == 2 * p.layer + 1);
                    prop_assert!(off + len <= (r + 1) * region, "straddles region {}", r);
                    spans.push((off, off + len));
                }
            }
            spans.sort();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
            }
            for (l, r) in img.layer_ranges().iter().enumerate() {
                if !r.is_empty() {
                    prop_assert!(r.start >= 2 * l * region && r.end <= (2 * l + 2) * region);
                }
            }
        }
    }

    proptest! {
        /// The pieces tile the range in order, each inside one region.
        #[test]
        fn region_pieces_tile_the_range(off in 0usize..5000, len in 0usize..5000, region in 1usize..700) {
            let p = region_pieces(off, len, region);
            let mut at = off;
            for &(o, n) in &p {
                prop_assert_eq!(o, at);
                prop_assert!(n > 0);
                prop_assert_eq!(o / region, (o + n - 1) / region);
                at += n;
            }
            prop_assert_eq!(at, off + len);
            prop_assert_eq!(region_pieces(off, len, 0), vec![(off, len)]);
        }
    }

    /// A rank-64 q,k,v,o bf16 adapter of Llama-2-7B shapes (4 MiB a layer) in 16-token bf16 KV
    /// blocks (128 KiB a layer's K or V block, 8 MiB a page): 16 pages, exactly its bytes over
    /// the page size. A chunk off the 256-byte grid has no paged image.
    #[test]
    fn a_7b_rank_64_adapter_takes_its_bytes_in_pages() {
        let (h, r) = (4096usize, 64usize);
        let fs: Vec<Factor> = (0..32)
            .flat_map(|l| {
                [LoraModule::Q, LoraModule::K, LoraModule::V, LoraModule::O]
                    .map(|m| (l, m, r as u32, 2.0, r * h * 2, h * r * 2))
            })
            .collect();
        let (n, img) = ImageLayout::pages_needed(32, &fs, 128 << 10).unwrap();
        assert_eq!(n, 16);
        assert_eq!(img.total, 16 * (8 << 20));
        assert!(ImageLayout::pages_needed(32, &fs, 1000).is_none());
    }

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
