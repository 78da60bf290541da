//! What a device backend asked of the driver on its compute stream (issue 29): kernel launches,
//! library products, graph launches, device allocations, host ↔ device copies and host
//! synchronisations, as running totals. Two snapshots around a step give that step's counts
//! ([`DeviceCounts::since`]); `thaw-bench gpu` prints them per decode step and the GPU parity
//! suite bounds them for a steady-state eager decode step, so a per-op allocation, a per-layer
//! upload or a stray synchronisation shows as a number, not only as a slower step.
//!
//! Pure data: the CUDA backend keeps the running totals (`cuda/counters.rs`); the CPU backend
//! has none.

/// Running totals (or, after [`DeviceCounts::since`], the counts of an interval).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Kernels launched by the backend itself (`cuLaunchKernel`).
    pub launches: u64,
    /// cuBLAS products (each may launch one or more kernels of its own), cuBLASLt's included.
    pub gemms: u64,
    /// Of those, the products run through cuBLASLt (`THAW_CUDA_CUBLASLT=1`).
    pub lt_products: u64,
    /// cuBLASLt products whose epilogue added the bias: `add_bias` launches saved.
    pub bias_epilogues: u64,
    /// CUDA graphs launched (a replayed decode step is one).
    pub graph_launches: u64,
    /// Device allocations, and their bytes.
    pub allocs: u64,
    pub alloc_bytes: u64,
    /// Host → device copies on the compute stream, and their bytes.
    pub htod: u64,
    pub htod_bytes: u64,
    /// Device → host copies, and their bytes.
    pub dtoh: u64,
    pub dtoh_bytes: u64,
    /// Times the host waited for the compute stream.
    pub syncs: u64,
}

impl DeviceCounts {
    /// The counts between `earlier` and `self` (both running totals of one backend).
    pub fn since(&self, earlier: &DeviceCounts) -> DeviceCounts {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        DeviceCounts {
            launches: d(self.launches, earlier.launches),
            gemms: d(self.gemms, earlier.gemms),
            lt_products: d(self.lt_products, earlier.lt_products),
            bias_epilogues: d(self.bias_epilogues, earlier.bias_epilogues),
            graph_launches: d(self.graph_launches, earlier.graph_launches),
            allocs: d(self.allocs, earlier.allocs),
            alloc_bytes: d(self.alloc_bytes, earlier.alloc_bytes),
            htod: d(self.htod, earlier.htod),
            htod_bytes: d(self.htod_bytes, earlier.htod_bytes),
            dtoh: d(self.dtoh, earlier.dtoh),
            dtoh_bytes: d(self.dtoh_bytes, earlier.dtoh_bytes),
            syncs: d(self.syncs, earlier.syncs),
        }
    }

    /// Every count with its name, in table order.
    pub fn fields(&self) -> [(&'static str, u64); 12] {
        [
            ("kernel launches", self.launches),
            ("cuBLAS products", self.gemms),
            ("of which cuBLASLt", self.lt_products),
            (
                "bias epilogues (add_bias launches saved)",
                self.bias_epilogues,
            ),
            ("graph launches", self.graph_launches),
            ("device allocations", self.allocs),
            ("allocated bytes", self.alloc_bytes),
            ("host→device copies", self.htod),
            ("host→device bytes", self.htod_bytes),
            ("device→host copies", self.dtoh),
            ("device→host bytes", self.dtoh_bytes),
            ("host synchronisations", self.syncs),
        ]
    }

    /// Each count divided by `steps` (at least 1): per-step means for a table.
    pub fn per_step(&self, steps: usize) -> [(&'static str, f64); 12] {
        let n = steps.max(1) as f64;
        self.fields().map(|(name, v)| (name, v as f64 / n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn counts(v: [u64; 12]) -> DeviceCounts {
        DeviceCounts {
            launches: v[0],
            gemms: v[1],
            lt_products: v[2],
            bias_epilogues: v[3],
            graph_launches: v[4],
            allocs: v[5],
            alloc_bytes: v[6],
            htod: v[7],
            htod_bytes: v[8],
            dtoh: v[9],
            dtoh_bytes: v[10],
            syncs: v[11],
        }
    }

    #[test]
    fn fields_name_every_count_once_in_order() {
        let c = counts([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let values: Vec<u64> = c.fields().iter().map(|f| f.1).collect();
        assert_eq!(values, (1..=12).collect::<Vec<u64>>());
        let mut names: Vec<&str> = c.fields().iter().map(|f| f.0).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 12);
        let per = c.per_step(4);
        assert_eq!(per[0], ("kernel launches", 0.25));
        assert_eq!(per[2], ("of which cuBLASLt", 0.75));
        assert_eq!(per[11], ("host synchronisations", 3.0));
        assert_eq!(c.per_step(0)[1].1, 2.0, "zero steps divide by one");
    }

    proptest! {
        /// The counts of an interval added to its start give its end, field by field; an
        /// earlier snapshot taken as the later one gives zeros, never a wrap.
        #[test]
        fn since_is_the_difference_of_running_totals(
            start in proptest::array::uniform12(0u64..1 << 40),
            delta in proptest::array::uniform12(0u64..1 << 20),
        ) {
            let a = counts(start);
            let b = counts(std::array::from_fn(|i| start[i] + delta[i]));
            prop_assert_eq!(b.since(&a), counts(delta));
            prop_assert_eq!(a.since(&b), DeviceCounts::default());
            prop_assert_eq!(a.since(&a), DeviceCounts::default());
        }
    }
}
