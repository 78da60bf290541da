//! [`HostVec`]: a weight's elements in host memory, either an ordinary `Vec` (as loaded) or a
//! copy packed into a [`HugeArena`] (the CPU backend's resident weights).

use std::ops::{Deref, DerefMut};

use super::sys::{HugeArena, HugeSlice};

/// Elements of `T` owned either by a `Vec` or by a slice of a huge-page [`HugeArena`]; reads
/// and writes go through the slice either way. Cloning gives an ordinary `Vec` copy.
pub struct HostVec<T>(Repr<T>);

enum Repr<T> {
    Heap(Vec<T>),
    Huge(HugeSlice<T>),
}

impl<T: Copy> HostVec<T> {
    /// Moves the elements into `arena` (one copy; the `Vec` is freed). Already packed
    /// elements stay where they are.
    pub fn pack_into(&mut self, arena: &mut HugeArena) -> std::io::Result<()> {
        if let Repr::Heap(v) = &self.0 {
            self.0 = Repr::Huge(arena.place(v)?);
        }
        Ok(())
    }
}

impl<T> HostVec<T> {
    /// Whether the elements live in a [`HugeArena`].
    pub fn is_packed(&self) -> bool {
        matches!(self.0, Repr::Huge(_))
    }

    /// The elements as a `Vec` (a copy when packed).
    pub fn into_vec(self) -> Vec<T>
    where
        T: Clone,
    {
        match self.0 {
            Repr::Heap(v) => v,
            Repr::Huge(s) => s.to_vec(),
        }
    }
}

impl<T> Deref for HostVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::Heap(v) => v,
            Repr::Huge(s) => s,
        }
    }
}

impl<T> DerefMut for HostVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Repr::Heap(v) => v,
            Repr::Huge(s) => s,
        }
    }
}

impl<T> From<Vec<T>> for HostVec<T> {
    fn from(v: Vec<T>) -> Self {
        Self(Repr::Heap(v))
    }
}

impl<T> FromIterator<T> for HostVec<T> {
    fn from_iter<I: IntoIterator<Item = T>>(it: I) -> Self {
        Self(Repr::Heap(it.into_iter().collect()))
    }
}

impl<T: Clone> Clone for HostVec<T> {
    fn clone(&self) -> Self {
        Self(Repr::Heap(self.to_vec()))
    }
}

impl<T: PartialEq> PartialEq for HostVec<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for HostVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::sys::{ARENA_ALIGN, HUGE_PAGE};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Packed vectors keep their elements, start on a cache line, never overlap one
        /// another, and stay writable on their own (a write to one leaves the others intact).
        #[test]
        fn packed_vectors_keep_their_elements_and_never_overlap(
            lens in proptest::collection::vec(0usize..300_000, 1..12),
            seed in any::<u32>(),
        ) {
            let mut arena = HugeArena::new(true);
            let mut vs: Vec<HostVec<f32>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|j| (seed as f32) + (i * 1_000_003 + j) as f32).collect())
                .collect();
            let want: Vec<Vec<f32>> = vs.iter().map(|v| v.to_vec()).collect();
            for v in &mut vs {
                v.pack_into(&mut arena).unwrap();
                prop_assert!(v.is_packed());
            }
            let mut spans: Vec<(usize, usize)> = Vec::new();
            for (v, w) in vs.iter().zip(&want) {
                prop_assert_eq!(&v[..], &w[..]);
                let a = v.as_ptr() as usize;
                prop_assert_eq!(a % ARENA_ALIGN, 0);
                spans.push((a, a + v.len() * 4));
            }
            spans.sort_unstable();
            for p in spans.windows(2) {
                prop_assert!(p[0].1 <= p[1].0, "{:?} overlaps {:?}", p[0], p[1]);
            }
            for v in vs.iter_mut() {
                for x in v.iter_mut() {
                    *x = -*x;
                }
            }
            for (v, w) in vs.iter().zip(&want) {
                prop_assert!(v.iter().zip(w).all(|(a, b)| *a == -*b));
                prop_assert_eq!(v.clone().into_vec().len(), w.len());
            }
        }
    }

    /// A slice larger than a chunk gets a mapping of its own, aligned to a huge page.
    #[test]
    fn a_large_slice_starts_on_a_huge_page() {
        let mut arena = HugeArena::new(false);
        let n = (80 << 20) / 4;
        let mut v: HostVec<f32> = (0..n).map(|i| i as f32).collect();
        v.pack_into(&mut arena).unwrap();
        assert_eq!(v.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(v[n - 1], (n - 1) as f32);
        assert_eq!(v[12345], 12345.0);
    }
}
