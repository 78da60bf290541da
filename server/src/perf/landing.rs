//! When a cold adapter's layers land on the device, layer by layer (issue 27): the upload
//! pipeline reads each layer (from its mapped file, or from host memory), checks and encodes
//! it into the pinned arena, and queues its copy as soon as that layer is in, so copies of
//! early layers overlap reads of later ones; and a request's forward can start as soon as
//! layer 0 is on the device, as long as every layer has landed by the time the forward
//! reaches it. Part of the one performance model ([`super::PerfModel`] builds one from its
//! measured rates, [`crate::coldstart`] decides with it).
//!
//! With uniform layers (the layers of one adapter are alike), `n` layers, `q` seconds before
//! the first read starts (the reads queued ahead of it), `r` seconds to read, check and
//! encode one layer, `c` seconds to copy one, and the link busy for `b` seconds with copies
//! queued ahead:
//!
//! ```text
//! R_l  = q + (l + 1)·r                        layer l is in the arena
//! C_-1 = b
//! C_l  = max(R_l, C_{l-1}) + c                layer l is on the device (one link, in order)
//! wait(t) = max(0, max_l (C_l − (first + l)·t))   t: the forward's time per layer
//! whole   = max(q + n·r, b) + n·c             the whole read, then the whole copy
//! ```
//!
//! `wait(t)` is the earliest start of a forward that never reaches a layer before it lands;
//! `first` is the index of the first layer still to land (layers before it are on the device).
//! `wait ≤ whole` (each `C_l ≤ C_{n−1} ≤ whole`), with equality for one layer and `first` 0.

/// The landing of a cold adapter's layers still to land (see the module's formulas).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LayerLanding {
    /// Layers still to land (`n`).
    pub layers: usize,
    /// Index of the first of them in the model (`first`): the forward reaches it after
    /// passing that many layers.
    pub first: usize,
    /// Seconds before the first layer's read starts (`q`): reads queued ahead of it.
    pub queue_s: f64,
    /// Seconds to read, check and encode one layer into the arena (`r`); 0 when its image is
    /// in the arena already.
    pub read_s: f64,
    /// Seconds one layer takes on the link (`c`), its latency included.
    pub copy_s: f64,
    /// Seconds until the link has sent the copies queued ahead of it (`b`).
    pub link_busy_s: f64,
}

impl LayerLanding {
    /// `C_l` for every layer still to land, in order (from now, seconds).
    pub fn landed_at(&self) -> impl Iterator<Item = f64> {
        let (q, r, c) = (
            self.queue_s.max(0.0),
            self.read_s.max(0.0),
            self.copy_s.max(0.0),
        );
        (0..self.layers).scan(self.link_busy_s.max(0.0), move |prev, l| {
            let read = q + (l + 1) as f64 * r;
            *prev = read.max(*prev) + c;
            Some(*prev)
        })
    }

    /// Seconds until every layer has landed (`C_{n−1}`; 0 with none to land).
    pub fn all_landed_s(&self) -> f64 {
        self.landed_at().last().unwrap_or(0.0)
    }

    /// Seconds a request waits before its forward may start, the forward taking `layer_s`
    /// seconds a layer, so that it never reaches a layer that has not landed: 0 when every
    /// layer lands before the forward gets to it.
    pub fn wait_s(&self, layer_s: f64) -> f64 {
        let t = layer_s.max(0.0);
        self.landed_at()
            .enumerate()
            .map(|(l, at)| at - (self.first + l) as f64 * t)
            .fold(0.0, f64::max)
    }

    /// What the same stages cost a request that waits for the whole read before any copy and
    /// for every copy before its forward (the model before layer-wise landing).
    pub fn whole_file_wait_s(&self) -> f64 {
        if self.layers == 0 {
            return 0.0;
        }
        let n = self.layers as f64;
        let read = self.queue_s.max(0.0) + n * self.read_s.max(0.0);
        read.max(self.link_busy_s.max(0.0)) + n * self.copy_s.max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `C_l` in closed form for uniform stages: the link's own pace from its backlog, or the
    /// read of the slowest stage's bottleneck layer (the last read when reads are slower than
    /// copies, the first otherwise) followed by the copies after it.
    fn closed_form(x: &LayerLanding, l: usize) -> f64 {
        let (q, r, c, b) = (x.queue_s, x.read_s, x.copy_s, x.link_busy_s);
        let k = (l + 1) as f64;
        let reads = if r >= c { q + k * r + c } else { q + r + k * c };
        reads.max(b + k * c)
    }

    fn any_landing() -> impl Strategy<Value = LayerLanding> {
        (
            1usize..48,
            0usize..8,
            prop_oneof![Just(0.0), 0.0f64..2.0],
            prop_oneof![Just(0.0), 0.0f64..0.1],
            0.0f64..0.05,
            prop_oneof![Just(0.0), 0.0f64..1.0],
        )
            .prop_map(|(layers, first, q, r, c, b)| LayerLanding {
                layers,
                first,
                queue_s: q,
                read_s: r,
                copy_s: c,
                link_busy_s: b,
            })
    }

    #[test]
    fn an_h100_disk_miss_lands_at_the_pace_of_its_reads() {
        // 32 layers of a 134 MB adapter: 16.5 ms to read and encode each, 86 µs to copy;
        // a 128-token prefill takes 1.02 ms a layer.
        let x = LayerLanding {
            layers: 32,
            first: 0,
            queue_s: 0.0,
            read_s: 16.5e-3,
            copy_s: 86e-6,
            link_busy_s: 0.0,
        };
        assert!((x.all_landed_s() - (32.0 * 16.5e-3 + 86e-6)).abs() < 1e-12);
        // The forward starts once all but the last layer's lead over it has passed.
        let want = 32.0 * 16.5e-3 + 86e-6 - 31.0 * 1.02e-3;
        assert!(
            (x.wait_s(1.02e-3) - want).abs() < 1e-12,
            "{}",
            x.wait_s(1.02e-3)
        );
        // Before, the whole read then the whole copy.
        assert!((x.whole_file_wait_s() - (32.0 * 16.5e-3 + 32.0 * 86e-6)).abs() < 1e-12);
        // Half landed already (streaming): the forward passes 16 layers before it needs one.
        let rest = LayerLanding {
            layers: 16,
            first: 16,
            read_s: 0.0,
            ..x
        };
        assert_eq!(rest.wait_s(1.0), 0.0);
        assert!((rest.wait_s(0.0) - 16.0 * 86e-6).abs() < 1e-12);
    }

    proptest! {
        /// The recurrence is the closed form; landings are in order, the first no earlier
        /// than its read and copy, the last no later than the whole-file model's.
        #[test]
        fn the_landings_follow_the_closed_form(x in any_landing()) {
            let at: Vec<f64> = x.landed_at().collect();
            prop_assert_eq!(at.len(), x.layers);
            for (l, &t) in at.iter().enumerate() {
                let want = closed_form(&x, l);
                prop_assert!((t - want).abs() <= 1e-9 * want.max(1.0), "{} {} {}", l, t, want);
            }
            prop_assert!(at.windows(2).all(|w| w[0] <= w[1]));
            prop_assert!(at[0] >= x.queue_s + x.read_s + x.copy_s - 1e-12);
            prop_assert!(x.all_landed_s() <= x.whole_file_wait_s() * (1.0 + 1e-12));
        }

        /// Layer-wise wait ≤ the whole-file wait, equal for one layer the forward reaches
        /// first; never below the first layer's landing (nothing runs before layer 0 is on
        /// the device) unless it is past already; an instant forward waits for every layer.
        #[test]
        fn the_layer_wise_wait_is_within_the_whole_file_wait(
            x in any_landing(),
            t in prop_oneof![Just(0.0), 0.0f64..0.05],
        ) {
            let w = x.wait_s(t);
            prop_assert!(w >= 0.0);
            prop_assert!(w <= x.whole_file_wait_s() * (1.0 + 1e-12) + 1e-15, "{} > {}", w, x.whole_file_wait_s());
            if x.first == 0 {
                prop_assert!(w >= x.landed_at().next().unwrap() - 1e-12);
            }
            prop_assert!((x.wait_s(0.0) - x.all_landed_s()).abs() <= 1e-12);
            let one = LayerLanding { layers: 1, first: 0, ..x };
            prop_assert!((one.wait_s(t) - one.whole_file_wait_s()).abs() <= 1e-12);
        }

        /// Serving a disk miss from its file (each layer read, checked and encoded by the
        /// upload pipeline, behind no loader queue) never lands a layer later, nor makes its
        /// request wait longer, than waiting for the loader's queue and whole read first and
        /// then copying from memory (why every policy serves disk misses from their files:
        /// `ColdStartPolicy::serves_disk_miss_from_file`).
        #[test]
        fn reading_from_the_file_never_lands_later_than_the_loaders_whole_read(
            x in any_landing(),
            t in 0.0f64..0.05,
        ) {
            let file = LayerLanding { first: 0, queue_s: 0.0, ..x };
            let loader = LayerLanding {
                first: 0,
                queue_s: x.queue_s + x.layers as f64 * x.read_s,
                read_s: 0.0,
                ..x
            };
            for (a, b) in file.landed_at().zip(loader.landed_at()) {
                prop_assert!(a <= b + 1e-12, "{} > {}", a, b);
            }
            prop_assert!(file.wait_s(t) <= loader.wait_s(t) + 1e-12);
        }

        /// A slower disk (longer reads), a longer queue ahead, a slower or busier link never
        /// shorten the wait; a slower forward (more time to reach each layer) never lengthens
        /// it, nor do layers already landed ahead of the rest.
        #[test]
        fn the_wait_is_monotone_in_every_stage(
            x in any_landing(),
            t in 0.0f64..0.05,
            more in 0.0f64..0.1,
            first in 0usize..8,
        ) {
            let w = x.wait_s(t);
            let eps = 1e-12 * w.max(1.0);
            let slower = [
                LayerLanding { read_s: x.read_s + more, ..x },
                LayerLanding { queue_s: x.queue_s + more, ..x },
                LayerLanding { copy_s: x.copy_s + more, ..x },
                LayerLanding { link_busy_s: x.link_busy_s + more, ..x },
            ];
            for s in slower {
                prop_assert!(s.wait_s(t) >= w - eps, "{:?}: {} < {}", s, s.wait_s(t), w);
                prop_assert!(s.whole_file_wait_s() >= x.whole_file_wait_s() - eps);
            }
            prop_assert!(x.wait_s(t + more) <= w + eps);
            let ahead = LayerLanding { first: x.first + first, ..x };
            prop_assert!(ahead.wait_s(t) <= w + eps);
        }
    }
}
