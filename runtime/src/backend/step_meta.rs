//! Per-step device metadata, built on the host: what a GPU backend uploads once per step into
//! persistent device buffers and every layer then reuses (Punica: segment indices built once per
//! step; the same buffers a captured CUDA graph would read). Pure functions over the engine's
//! [`StepLayout`] and [`LoraLayout`], so they are tested here without a GPU; the CUDA backend's
//! `step.rs` uploads what they build.
use std::ops::Range;

use super::{LoraLayout, StepLayout};

/// Where each of [`AttnHost`]'s arrays lies in its packed form ([`AttnHost::pack`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttnParts {
    pub slots: Range<usize>,
    pub tables: Range<usize>,
    pub decode: Range<usize>,
    pub tiles: Range<usize>,
}

/// Attention metadata of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttnHost {
    /// Cache slot (`block · block_size + offset`) each row's K/V is written to.
    pub slots: Vec<u32>,
    /// The step's block tables, concatenated (a copy of [`StepLayout::block_tables`]).
    pub tables: Vec<u32>,
    /// (table offset, position, row) per decode row (a sequence with one row this step).
    pub decode: Vec<u32>,
    /// (table offset, first position, first row, rows) per prefill tile of ≤ `tile_rows` rows.
    pub tiles: Vec<u32>,
}

impl AttnHost {
    /// Decode rows.
    pub fn n_decode(&self) -> usize {
        self.decode.len() / 3
    }

    /// Prefill tiles.
    pub fn n_tiles(&self) -> usize {
        self.tiles.len() / 4
    }

    /// The four arrays one after another in `out` (cleared first, capacity kept), so that a
    /// backend uploads them in one copy; where each lies in it.
    pub fn pack(&self, out: &mut Vec<u32>) -> AttnParts {
        out.clear();
        let mut part = |v: &[u32]| {
            let start = out.len();
            out.extend_from_slice(v);
            start..out.len()
        };
        AttnParts {
            slots: part(&self.slots),
            tables: part(&self.tables),
            decode: part(&self.decode),
            tiles: part(&self.tiles),
        }
    }

    /// Rebuilds the metadata for `step` in place (the vectors keep their capacity).
    /// `num_blocks` bounds every table entry; `tile_rows` is the prefill kernel's query tile.
    ///
    /// # Panics
    /// If a sequence's block table cannot hold its positions or names a block ≥ `num_blocks`
    /// (the engine's block manager guarantees neither happens).
    pub fn build(
        &mut self,
        step: &StepLayout,
        block_size: usize,
        num_blocks: usize,
        tile_rows: usize,
    ) {
        assert!(
            block_size > 0 && tile_rows > 0,
            "block_size and tile_rows must be > 0"
        );
        self.slots.clear();
        self.slots.resize(step.rows(), 0);
        self.decode.clear();
        self.tiles.clear();
        self.tables.clear();
        self.tables.extend_from_slice(&step.block_tables);
        for s in &step.seqs {
            let table = &step.block_tables[s.blocks.clone()];
            let last = s.start_pos + s.rows.len();
            assert!(
                table.len() * block_size >= last,
                "attention: block table of {} blocks cannot hold {last} positions",
                table.len()
            );
            assert!(
                table.iter().all(|&b| (b as usize) < num_blocks),
                "attention: block table names a block beyond the {num_blocks} allocated"
            );
            for (i, r) in s.rows.clone().enumerate() {
                let pos = s.start_pos + i;
                self.slots[r] =
                    table[pos / block_size] * block_size as u32 + (pos % block_size) as u32;
            }
            let off = s.blocks.start as u32;
            if s.rows.len() == 1 {
                self.decode
                    .extend([off, s.start_pos as u32, s.rows.start as u32]);
            } else {
                for t0 in s.rows.clone().step_by(tile_rows) {
                    let n = (s.rows.end - t0).min(tile_rows);
                    let pos0 = s.start_pos + (t0 - s.rows.start);
                    self.tiles.extend([off, pos0 as u32, t0 as u32, n as u32]);
                }
            }
        }
    }
}

/// LoRA metadata of one step: SGMV segments and BGMV per-row tables, both naming adapters by
/// their device descriptor table's address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoraHost {
    /// Descriptor table address per kept segment.
    pub seg_tables: Vec<u64>,
    /// (first row, end row) per kept segment.
    pub seg_rows: Vec<u32>,
    /// Descriptor table address per row; 0 = no LoRA on the device for that row.
    pub row_tables: Vec<u64>,
}

impl LoraHost {
    /// Kept segments.
    pub fn n_segs(&self) -> usize {
        self.seg_tables.len()
    }

    /// Rows of the longest kept segment.
    pub fn max_seg_rows(&self) -> usize {
        self.seg_rows
            .chunks_exact(2)
            .map(|r| (r[1] - r[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    /// Rebuilds the metadata for `layout` in place. `table(i)` is step adapter `i`'s descriptor
    /// table address, or `None` while its layer is not on the device (those rows are computed
    /// elsewhere and get no segment and a 0 row table); empty segments are dropped.
    pub fn build(&mut self, layout: &LoraLayout, table: impl Fn(u32) -> Option<u64>) {
        self.seg_tables.clear();
        self.seg_rows.clear();
        for (rows, idx) in &layout.segments {
            let Some(addr) = table(*idx).filter(|_| !rows.is_empty()) else {
                continue;
            };
            self.seg_tables.push(addr);
            self.seg_rows.extend([rows.start as u32, rows.end as u32]);
        }
        self.row_tables.clear();
        self.row_tables.extend(
            layout
                .row_adapter
                .iter()
                .map(|i| i.and_then(&table).unwrap_or(0)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqSlice;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// A step of `seqs` (start position, rows) with disjoint, shuffled block tables.
    fn step_of(seqs: &[(usize, usize)], block_size: usize, seed: u64) -> (StepLayout, usize) {
        let mut step = StepLayout::default();
        let total: usize = seqs
            .iter()
            .map(|&(s, n)| (s + n).div_ceil(block_size))
            .sum();
        // A fixed permutation of 0..total: multiplication by an odd number mod a power of two.
        let m = total.next_power_of_two().max(2);
        let perm: Vec<u32> = (0..m)
            .map(|i| ((i * (2 * seed as usize + 1) + 3) % m) as u32)
            .filter(|&b| (b as usize) < total)
            .collect();
        let (mut row, mut next) = (0, 0);
        for &(start, n) in seqs {
            let blocks = (start + n).div_ceil(block_size);
            let b0 = step.block_tables.len();
            step.block_tables
                .extend_from_slice(&perm[next..next + blocks]);
            next += blocks;
            step.seqs.push(SeqSlice {
                rows: row..row + n,
                start_pos: start,
                blocks: b0..b0 + blocks,
            });
            step.token_ids.extend(std::iter::repeat_n(1, n));
            step.positions.extend(start..start + n);
            row += n;
        }
        (step, total)
    }

    #[test]
    fn a_mixed_step_gets_decode_rows_and_prefill_tiles() {
        // Block tables in order: seq 0 has blocks 0, 1; seq 1 block 2; seq 2 block 3.
        let (mut step, nb) = step_of(&[(0, 20), (5, 1), (0, 1)], 16, 0);
        step.block_tables = vec![0, 1, 2, 3];
        let mut a = AttnHost::default();
        a.build(&step, 16, nb, 16);
        assert_eq!(a.decode, vec![2, 5, 20, 3, 0, 21]);
        assert_eq!(a.tiles, vec![0, 0, 0, 16, 0, 16, 16, 4]);
        assert_eq!(a.slots[19], 16 + 3);
        assert_eq!(a.slots[20], 2 * 16 + 5);
        assert_eq!(a.slots[21], 3 * 16);
        assert_eq!((a.n_decode(), a.n_tiles()), (2, 2));
    }

    #[test]
    #[should_panic(expected = "cannot hold")]
    fn a_short_block_table_is_refused() {
        let (mut step, nb) = step_of(&[(0, 20)], 16, 0);
        step.seqs[0].blocks = 0..1;
        AttnHost::default().build(&step, 16, nb, 16);
    }

    proptest! {
        /// The packed form holds each array, in order, at its range; the ranges tile it; a
        /// second pack into the same vector gives the same (nothing left from the first).
        #[test]
        fn the_packed_metadata_holds_each_array_at_its_range(
            seqs in prop::collection::vec((0usize..100, 1usize..40), 1..12),
            bs in prop::sample::select(vec![1usize, 8, 16]),
            seed in 0u64..1000,
        ) {
            let (step, nb) = step_of(&seqs, bs, seed);
            let mut a = AttnHost::default();
            a.build(&step, bs, nb, 7);
            let mut out = vec![9; 3];
            let p = a.pack(&mut out);
            prop_assert_eq!(&out[p.slots.clone()], &a.slots[..]);
            prop_assert_eq!(&out[p.tables.clone()], &a.tables[..]);
            prop_assert_eq!(&out[p.decode.clone()], &a.decode[..]);
            prop_assert_eq!(&out[p.tiles.clone()], &a.tiles[..]);
            prop_assert_eq!(
                (p.slots.start, p.slots.end, p.tables.end, p.decode.end, p.tiles.end),
                (0, p.tables.start, p.decode.start, p.tiles.start, out.len())
            );
            let again = out.clone();
            prop_assert_eq!(a.pack(&mut out), p);
            prop_assert_eq!(out, again);
        }

        #[test]
        fn every_row_gets_its_own_slot_and_exactly_one_kernel(
            seqs in prop::collection::vec((0usize..100, 1usize..40), 1..12),
            bs in prop::sample::select(vec![1usize, 8, 16, 32]),
            tile in 1usize..20,
            seed in 0u64..1000,
        ) {
            let (step, nb) = step_of(&seqs, bs, seed);
            let mut a = AttnHost::default();
            a.build(&step, bs, nb, tile);
            // Disjoint tables: no two rows write the same cache slot.
            let distinct: HashSet<u32> = a.slots.iter().copied().collect();
            prop_assert_eq!(distinct.len(), step.rows());
            prop_assert!(a.slots.iter().all(|&s| (s as usize) < nb * bs));
            prop_assert_eq!(&a.tables, &step.block_tables);
            // Each row is attended by one decode entry or one tile, at its own position.
            let mut covered = vec![0; step.rows()];
            for d in a.decode.chunks_exact(3) {
                covered[d[2] as usize] += 1;
                prop_assert_eq!(d[1] as usize, step.positions[d[2] as usize]);
            }
            for t in a.tiles.chunks_exact(4) {
                prop_assert!(t[3] as usize >= 1 && t[3] as usize <= tile);
                for k in 0..t[3] as usize {
                    let r = t[2] as usize + k;
                    covered[r] += 1;
                    prop_assert_eq!(t[1] as usize + k, step.positions[r]);
                }
            }
            prop_assert!(covered.iter().all(|&c| c == 1));
            // A rebuild of the same step reuses the buffers and gives the same metadata.
            let before = a.clone();
            a.build(&step, bs, nb, tile);
            prop_assert_eq!(a, before);
        }

        #[test]
        fn lora_rows_point_at_their_adapter_only_while_it_is_on_the_device(
            runs in prop::collection::vec((0usize..6, prop::option::of(0u32..4)), 0..20),
            on in prop::collection::vec(any::<bool>(), 4),
        ) {
            let mut layout = LoraLayout::default();
            for (len, idx) in &runs {
                let r0 = layout.row_adapter.len();
                layout.row_adapter.extend(std::iter::repeat_n(*idx, *len));
                if let Some(i) = idx {
                    layout.segments.push((r0..r0 + len, *i));
                }
            }
            let table = |i: u32| on[i as usize].then_some(0x1000 * (u64::from(i) + 1));
            let mut h = LoraHost::default();
            h.build(&layout, table);
            prop_assert_eq!(h.row_tables.len(), layout.row_adapter.len());
            for (r, idx) in layout.row_adapter.iter().enumerate() {
                prop_assert_eq!(h.row_tables[r], idx.and_then(table).unwrap_or(0));
            }
            // Segments: the non-empty on-device ones, in order, and their rows agree with the
            // per-row tables.
            let want: Vec<_> = layout
                .segments
                .iter()
                .filter(|(rows, i)| !rows.is_empty() && on[*i as usize])
                .collect();
            prop_assert_eq!(h.n_segs(), want.len());
            for (s, (rows, _)) in want.iter().enumerate() {
                prop_assert_eq!(h.seg_rows[2 * s] as usize, rows.start);
                prop_assert_eq!(h.seg_rows[2 * s + 1] as usize, rows.end);
                for r in rows.clone() {
                    prop_assert_eq!(h.row_tables[r], h.seg_tables[s]);
                }
            }
            prop_assert_eq!(h.max_seg_rows(), want.iter().map(|(r, _)| r.len()).max().unwrap_or(0));
        }
    }
}
