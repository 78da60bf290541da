//! `thaw-bench gpu`'s table of driver calls per decode step (issue 29): for each decode row
//! (eager, and with CUDA graphs where they ran), what the backend asked of the driver on its
//! compute stream per timed step — kernel launches, cuBLAS products (and of those the cuBLASLt
//! ones, with the `add_bias` launches their bias epilogue saved), graph launches,
//! allocations, host → device copies and bytes, device → host copies, synchronisations
//! ([`DeviceCounts`]). A steady-state eager step should allocate nothing and upload a few
//! hundred bytes of metadata in a handful of copies; a replayed graph step launches one graph.
//! The CPU backend keeps no counts: the table says so.
use std::fmt::Write;

use thaw_runtime::backend::device_counts::DeviceCounts;

use super::cases::DecodeRow;

/// The table over `eager` and `graph` rows (either may be empty).
pub fn table(eager: &[DecodeRow], graph: &[DecodeRow]) -> String {
    let mut s = String::from(
        "\n### Driver calls per decode step (the backend's compute stream, mean over the timed steps)\n",
    );
    let rows: Vec<(&str, &DecodeRow, DeviceCounts)> = [("eager", eager), ("graph", graph)]
        .into_iter()
        .flat_map(|(mode, rows)| rows.iter().map(move |r| (mode, r)))
        .filter_map(|(mode, r)| r.counts.map(|c| (mode, r, c)))
        .collect();
    if rows.is_empty() {
        s.push_str("not counted: this backend keeps no driver counts\n");
        return s;
    }
    s.push_str("| mode | batch | adapters | launches | cuBLAS | of which Lt | bias epilogues | graphs | allocs | alloc KB | H→D copies | H→D bytes | D→H copies | syncs |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (mode, r, c) in rows {
        let p = |v: u64| v as f64 / r.steps.max(1) as f64;
        let _ = writeln!(
            s,
            "| {mode} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} |",
            r.batch,
            r.mix.label(),
            p(c.launches),
            p(c.gemms),
            p(c.lt_products),
            p(c.bias_epilogues),
            p(c.graph_launches),
            p(c.allocs),
            p(c.alloc_bytes) / 1024.0,
            p(c.htod),
            p(c.htod_bytes),
            p(c.dtoh),
            p(c.syncs),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::roofline::StepTraffic;
    use crate::gpu::Mix;

    fn row(batch: usize, counts: Option<DeviceCounts>) -> DecodeRow {
        DecodeRow {
            batch,
            mix: Mix::Base,
            step_ms: 1.0,
            tok_s: 1.0,
            traffic: StepTraffic::default(),
            counts,
            steps: 4,
        }
    }

    #[test]
    fn rows_show_per_step_means_and_uncounted_rows_are_left_out() {
        let c = DeviceCounts {
            launches: 400,
            gemms: 28,
            lt_products: 20,
            bias_epilogues: 8,
            htod: 12,
            htod_bytes: 600,
            syncs: 4,
            ..Default::default()
        };
        let g = DeviceCounts {
            graph_launches: 4,
            htod: 4,
            dtoh: 4,
            syncs: 4,
            ..Default::default()
        };
        let t = table(&[row(1, Some(c)), row(8, None)], &[row(1, Some(g))]);
        assert!(
            t.contains(
                "| eager | 1 | 0 | 100.0 | 7.0 | 5.0 | 2.0 | 0.0 | 0.00 | 0.0 | 3.0 | 150 | 0.0 | 1.0 |"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "| graph | 1 | 0 | 0.0 | 0.0 | 0.0 | 0.0 | 1.0 | 0.00 | 0.0 | 1.0 | 0 | 1.0 | 1.0 |"
            ),
            "{t}"
        );
        assert!(!t.contains("| eager | 8 |"), "a row without counts");
        let none = table(&[row(1, None)], &[]);
        assert!(none.contains("not counted"), "{none}");
    }
}
