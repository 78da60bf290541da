//! [`RopeTable::apply`] with each position's sines and cosines computed once: a step rotates
//! the queries and keys of every layer at the same positions (60 calls for SmolLM2's 30
//! layers), and a prompt of 2,048 tokens asked for four million f64 `sin_cos` per step.
//! The table grows to the largest position seen (`head_dim` floats a position) and gives
//! the same bits as [`RopeTable::apply`].
use super::rope::{rotate_token, sin_cos};
use super::RopeTable;

/// A [`RopeTable`] and the `(sin, cos)` of every position up to the largest it rotated.
#[derive(Clone, Debug)]
pub struct RopeCache {
    table: RopeTable,
    /// `[position][i] = (sin, cos)` for the table's `head_dim / 2` frequencies.
    sc: Vec<(f32, f32)>,
}

impl RopeCache {
    /// An empty cache over `table`.
    pub fn new(table: RopeTable) -> Self {
        Self {
            table,
            sc: Vec::new(),
        }
    }

    /// The table it caches.
    pub fn table(&self) -> &RopeTable {
        &self.table
    }

    /// [`RopeTable::apply`], bit for bit.
    pub fn apply(&mut self, x: &mut [f32], positions: &[usize], n_heads: usize) {
        self.prepare(positions);
        self.apply_prepared(x, positions, n_heads);
    }

    /// Grows the table to cover `positions`, so [`Self::apply_prepared`] (which takes `&self`,
    /// for threads rotating disjoint tokens at once) can rotate them.
    pub fn prepare(&mut self, positions: &[usize]) {
        let half = self.table.head_dim() / 2;
        if let (Some(&top), true) = (positions.iter().max(), half > 0) {
            let have = self.sc.len() / half;
            if top >= have {
                let freqs = self.table.inv_freq();
                self.sc
                    .extend((have..=top).flat_map(|p| freqs.iter().map(move |&f| sin_cos(p, f))));
            }
        }
    }

    /// [`Self::apply`] for positions [`Self::prepare`] covered: [`RopeTable::apply`] bit for
    /// bit. Panics on a position the table does not cover yet (a caller bug).
    pub fn apply_prepared(&self, x: &mut [f32], positions: &[usize], n_heads: usize) {
        if !self.table.check_shape(x, positions, n_heads) {
            return;
        }
        let d = self.table.head_dim();
        let half = d / 2;
        for (tok, &pos) in x.chunks_exact_mut(n_heads * d).zip(positions) {
            let sc = &self.sc[pos * half..(pos + 1) * half];
            rotate_token(tok, d, |i| sc[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::cpu::RopeScaling;

    proptest! {
        /// Any head size, scaling, positions (in any order, repeated, growing the cache
        /// between calls): the cached rotation is the table's bit for bit.
        #[test]
        fn cached_equals_uncached(
            half in 1usize..40,
            heads in 1usize..4,
            calls in prop::collection::vec(prop::collection::vec(0usize..3000, 1..12), 1..4),
            linear in any::<bool>(),
            seed in any::<u32>(),
        ) {
            let scaling = if linear { RopeScaling::Linear { factor: 4.0 } } else { RopeScaling::None };
            let table = RopeTable::new(2 * half, 10_000.0, &scaling);
            let mut cache = RopeCache::new(table.clone());
            for positions in calls {
                let n = positions.len() * heads * 2 * half;
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
                    .collect();
                let (mut a, mut b) = (x.clone(), x);
                table.apply(&mut a, &positions, heads);
                cache.apply(&mut b, &positions, heads);
                prop_assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
            }
        }
    }
}
