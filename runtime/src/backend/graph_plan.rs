//! CUDA-graph decode (issue 29), the host-side design as pure functions: which batch sizes get
//! a captured graph, which graph a decode step replays, and the persistent metadata buffer a
//! graph reads (a captured graph bakes in device addresses and launch shapes, so everything that
//! changes per step must live at fixed addresses with fixed capacities).
//!
//! Capture sizes follow vLLM's default (`cudagraph_capture_sizes`): 1, 2, 4, then every multiple
//! of 8 up to 256, then every multiple of 16, up to the largest size ≤ `max_num_seqs` and
//! ≤ [`MAX_CAPTURE_SIZE`]. A decode step of `n` sequences replays the smallest captured size
//! ≥ `n`, its rows past `n` padded with inert rows (token 0 at position 0 writing a scratch KV
//! slot, no adapter); a step with more sequences, or with any prefill rows, runs eagerly.
//!
//! Nothing here launches or captures anything: the capture itself (and its parity test against
//! eager steps) needs a GPU and is not built yet.
use super::{LoraLayout, StepLayout};

/// The largest batch vLLM captures by default.
pub const MAX_CAPTURE_SIZE: usize = 512;

/// The batch sizes that get a graph, ascending.
pub fn capture_sizes(max_num_seqs: usize) -> Vec<usize> {
    let cap = max_num_seqs.min(MAX_CAPTURE_SIZE);
    let small = [1, 2, 4].into_iter();
    let by8 = (8..=256).step_by(8);
    let by16 = (272..=MAX_CAPTURE_SIZE).step_by(16);
    small.chain(by8).chain(by16).filter(|&s| s <= cap).collect()
}

/// The captured size a decode step of `batch` sequences replays, or `None` (run eagerly) when
/// `batch` is 0 or above every captured size. `sizes` ascending, as [`capture_sizes`] gives.
pub fn bucket_for(batch: usize, sizes: &[usize]) -> Option<usize> {
    if batch == 0 {
        return None;
    }
    let i = sizes.partition_point(|&s| s < batch);
    sizes.get(i).copied()
}

/// "No adapter" in the row → adapter index region.
pub const NO_ADAPTER: u32 = u32::MAX;

/// Offsets (in u32 words) of one graph's persistent metadata in a single device buffer. Every
/// region has the capacity of the graph's `bucket` rows, whatever the step's real batch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GraphMetaLayout {
    pub bucket: usize,
    /// Block-table entries reserved per row (the longest context / block size, rounded up).
    pub max_blocks: usize,
    /// `[bucket]` token ids.
    pub tokens: usize,
    /// `[bucket]` positions.
    pub positions: usize,
    /// `[bucket]` KV slots written this step.
    pub slots: usize,
    /// `[bucket, 3]` (table offset, position, row): the decode attention's row metadata.
    pub decode: usize,
    /// `[bucket, max_blocks]` block tables, row `i`'s at `tables + i · max_blocks`.
    pub tables: usize,
    /// `[bucket]` adapter index per row (BGMV), [`NO_ADAPTER`] for none.
    pub row_adapter: usize,
    /// `[bucket, 3]` (first row, rows, adapter index) per SGMV segment, unused entries zero.
    pub segments: usize,
    /// `[1]` the number of live segments.
    pub n_segments: usize,
    /// Total words.
    pub len: usize,
}

impl GraphMetaLayout {
    pub fn new(bucket: usize, max_blocks: usize) -> Self {
        let mut at = 0;
        let mut take = |n: usize| {
            let o = at;
            at += n;
            o
        };
        let tokens = take(bucket);
        let positions = take(bucket);
        let slots = take(bucket);
        let decode = take(3 * bucket);
        let tables = take(bucket * max_blocks);
        let row_adapter = take(bucket);
        let segments = take(3 * bucket);
        let n_segments = take(1);
        Self {
            bucket,
            max_blocks,
            tokens,
            positions,
            slots,
            decode,
            tables,
            row_adapter,
            segments,
            n_segments,
            len: at,
        }
    }

    /// Writes a decode step into `out` (`len` words): real rows first, the rest padded with
    /// inert rows whose KV goes to `scratch_slot` (a slot no sequence owns) and whose table is
    /// all `scratch_block`. Returns an error when the step does not fit this graph (the caller
    /// then runs it eagerly).
    pub fn fill(
        &self,
        step: &StepLayout,
        lora: &LoraLayout,
        block_size: usize,
        (scratch_block, scratch_slot): (u32, u32),
        out: &mut [u32],
    ) -> Result<(), String> {
        let n = step.rows();
        if out.len() != self.len {
            return Err(format!(
                "buffer of {} words, layout has {}",
                out.len(),
                self.len
            ));
        }
        if n > self.bucket || step.seqs.len() != n {
            return Err(format!(
                "{n} rows in {} sequences do not fit a decode graph of {}",
                step.seqs.len(),
                self.bucket
            ));
        }
        out.fill(0);
        for (i, s) in step.seqs.iter().enumerate() {
            let table = &step.block_tables[s.blocks.clone()];
            if table.len() > self.max_blocks || s.rows != (i..i + 1) {
                return Err(format!(
                    "sequence {i}: {} blocks (graph holds {}), rows {:?}",
                    table.len(),
                    self.max_blocks,
                    s.rows
                ));
            }
            let pos = s.start_pos;
            if pos / block_size >= table.len() {
                return Err(format!(
                    "sequence {i}: position {pos} is past its block table"
                ));
            }
            let t0 = self.tables + i * self.max_blocks;
            out[t0..t0 + table.len()].copy_from_slice(table);
            out[self.tokens + i] = step.token_ids[i];
            out[self.positions + i] = pos as u32;
            out[self.slots + i] =
                table[pos / block_size] * block_size as u32 + (pos % block_size) as u32;
            out[self.decode + 3 * i..self.decode + 3 * i + 3].copy_from_slice(&[
                (i * self.max_blocks) as u32,
                pos as u32,
                i as u32,
            ]);
            out[self.row_adapter + i] = lora
                .row_adapter
                .get(i)
                .copied()
                .flatten()
                .unwrap_or(NO_ADAPTER);
        }
        for i in n..self.bucket {
            let t0 = self.tables + i * self.max_blocks;
            out[t0..t0 + self.max_blocks].fill(scratch_block);
            out[self.slots + i] = scratch_slot;
            out[self.decode + 3 * i..self.decode + 3 * i + 3].copy_from_slice(&[
                (i * self.max_blocks) as u32,
                0,
                i as u32,
            ]);
            out[self.row_adapter + i] = NO_ADAPTER;
        }
        if lora.segments.len() > self.bucket {
            return Err(format!(
                "{} segments exceed {}",
                lora.segments.len(),
                self.bucket
            ));
        }
        for (k, (rows, a)) in lora.segments.iter().enumerate() {
            let o = self.segments + 3 * k;
            out[o..o + 3].copy_from_slice(&[rows.start as u32, rows.len() as u32, *a]);
        }
        out[self.n_segments] = lora.segments.len() as u32;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqSlice;
    use proptest::prelude::*;

    #[test]
    fn capture_sizes_follow_vllm() {
        assert_eq!(capture_sizes(32), vec![1, 2, 4, 8, 16, 24, 32]);
        assert_eq!(capture_sizes(20), vec![1, 2, 4, 8, 16]);
        let all = capture_sizes(10_000);
        assert_eq!(all.last(), Some(&MAX_CAPTURE_SIZE));
        assert!(all.contains(&256) && all.contains(&272) && !all.contains(&264));
        assert_eq!(capture_sizes(1), vec![1]);
        assert_eq!(bucket_for(3, &capture_sizes(32)), Some(4));
        assert_eq!(bucket_for(33, &capture_sizes(32)), None);
    }

    proptest! {
        /// The bucket fits the batch, is the smallest captured size that does, and pads at
        /// most 7 rows up to 256 sequences (15 above); batches past the largest run eagerly.
        #[test]
        fn bucket_is_the_tightest_captured_size(max in 1usize..1000, batch in 0usize..1100) {
            let sizes = capture_sizes(max);
            prop_assert!(sizes.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(sizes.iter().all(|&s| s <= max.min(MAX_CAPTURE_SIZE)));
            match bucket_for(batch, &sizes) {
                Some(b) => {
                    prop_assert!(batch >= 1 && b >= batch && sizes.contains(&b));
                    prop_assert!(sizes.iter().all(|&s| s < batch || s >= b));
                    let slack = if batch <= 4 { 1 } else if b <= 256 { 7 } else { 15 };
                    prop_assert!(b - batch <= slack, "batch {} → {}", batch, b);
                }
                None => prop_assert!(batch == 0 || batch > *sizes.last().unwrap()),
            }
        }

        /// Regions tile the buffer without overlap; a filled step has its rows' data, inert
        /// padding rows (scratch slot, scratch tables, no adapter) and tables in range.
        #[test]
        fn filled_metadata_holds_the_step_and_inert_padding(
            batch in 1usize..40, extra in 0usize..9, max_blocks in 1usize..6, seed in 0u32..1000,
        ) {
            let bucket = batch + extra;
            let l = GraphMetaLayout::new(bucket, max_blocks);
            let regions = [
                (l.tokens, bucket), (l.positions, bucket), (l.slots, bucket), (l.decode, 3 * bucket),
                (l.tables, bucket * max_blocks), (l.row_adapter, bucket), (l.segments, 3 * bucket),
                (l.n_segments, 1),
            ];
            let mut at = 0;
            for (o, n) in regions {
                prop_assert_eq!(o, at);
                at += n;
            }
            prop_assert_eq!(at, l.len);
            let bs = 16;
            let mut step = StepLayout::default();
            let mut lora = LoraLayout::default();
            for i in 0..batch {
                let nb = 1 + (seed as usize + i) % max_blocks;
                let pos = (seed as usize * 7 + i * 13) % (nb * bs);
                let b0 = step.block_tables.len();
                step.block_tables.extend((0..nb).map(|k| (i * 10 + k) as u32));
                step.seqs.push(SeqSlice { rows: i..i + 1, start_pos: pos, blocks: b0..b0 + nb });
                step.token_ids.push(3 + i as u32);
                step.positions.push(pos);
                lora.row_adapter.push((i % 3 != 0).then_some((i % 2) as u32));
            }
            lora.segments.push((0..batch, 0));
            let mut buf = vec![7u32; l.len];
            l.fill(&step, &lora, bs, (999, 999 * bs as u32), &mut buf).unwrap();
            for i in 0..bucket {
                let d = &buf[l.decode + 3 * i..l.decode + 3 * i + 3];
                prop_assert_eq!(d[0] as usize, i * max_blocks);
                prop_assert_eq!(d[2] as usize, i);
                if i < batch {
                    let s = &step.seqs[i];
                    prop_assert_eq!(buf[l.tokens + i], step.token_ids[i]);
                    prop_assert_eq!(d[1] as usize, s.start_pos);
                    let t = &step.block_tables[s.blocks.clone()];
                    let want = t[s.start_pos / bs] * bs as u32 + (s.start_pos % bs) as u32;
                    prop_assert_eq!(buf[l.slots + i], want);
                    prop_assert_eq!(&buf[l.tables + i * max_blocks..][..t.len()], t);
                    prop_assert_eq!(buf[l.row_adapter + i], lora.row_adapter[i].unwrap_or(NO_ADAPTER));
                } else {
                    prop_assert_eq!(buf[l.slots + i], 999 * bs as u32);
                    prop_assert_eq!(buf[l.row_adapter + i], NO_ADAPTER);
                    prop_assert!(buf[l.tables + i * max_blocks..][..max_blocks].iter().all(|&b| b == 999));
                }
            }
            prop_assert_eq!(buf[l.n_segments], 1);
            prop_assert_eq!(&buf[l.segments..l.segments + 3], &[0, batch as u32, 0][..]);
        }
    }

    #[test]
    fn a_step_that_does_not_fit_is_refused() {
        let l = GraphMetaLayout::new(2, 1);
        let mut step = StepLayout::default();
        for i in 0..3 {
            step.block_tables.push(i);
            step.seqs.push(SeqSlice {
                rows: i as usize..i as usize + 1,
                start_pos: 0,
                blocks: i as usize..i as usize + 1,
            });
            step.token_ids.push(5);
        }
        let mut buf = vec![0; l.len];
        let e = l
            .fill(&step, &LoraLayout::default(), 16, (0, 0), &mut buf)
            .unwrap_err();
        assert!(e.contains("do not fit a decode graph of 2"), "{e}");
    }
}
