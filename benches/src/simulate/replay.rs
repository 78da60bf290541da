//! `--replay load.json`: the requests a `thaw-bench load` run sent (its send times, adapters,
//! prompt and output lengths), simulated on one instance, next to the TTFT the run measured —
//! the simulator's error against the real server it models.
use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

use super::cluster::simulate;
use super::instance::SimRequest;
use super::model::InstanceModel;
use super::report::quantile;
use super::router::{RouteCtx, RouterKind};

#[derive(Deserialize)]
struct LoadFile {
    requests: Vec<Record>,
}

#[derive(Deserialize)]
struct Record {
    model: String,
    rank: Option<usize>,
    scheduled_s: f64,
    prompt_tokens: usize,
    output_tokens: usize,
    ttft_s: Option<f64>,
}

/// Reads the successful requests of a `thaw-bench load` report: the requests and the TTFTs
/// measured for them.
pub fn read(path: &Path) -> anyhow::Result<(Vec<SimRequest>, Vec<f64>)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let f: LoadFile = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a `thaw-bench load` report (load.json)",
            path.display()
        )
    })?;
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut recs: Vec<&Record> = f.requests.iter().filter(|r| r.ttft_s.is_some()).collect();
    anyhow::ensure!(
        !recs.is_empty(),
        "{} has no successful request",
        path.display()
    );
    recs.sort_by(|a, b| a.scheduled_s.total_cmp(&b.scheduled_s));
    let mut reqs = Vec::new();
    let mut measured = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let n = ids.len() as u32;
        let adapter = *ids.entry(r.model.clone()).or_insert(n);
        reqs.push(SimRequest {
            id: i,
            at: r.scheduled_s,
            adapter,
            rank: r.rank.unwrap_or(0) as u32,
            prompt: r.prompt_tokens.max(1),
            output: r.output_tokens.max(1),
        });
        measured.extend(r.ttft_s);
    }
    Ok((reqs, measured))
}

/// The comparison table: measured vs simulated mean and P99 TTFT on one instance.
pub fn compare(model: &InstanceModel, path: &Path) -> anyhow::Result<String> {
    let (reqs, mut measured) = read(path)?;
    let mean_out = reqs.iter().map(|r| r.output as f64).sum::<f64>() / reqs.len() as f64;
    let ctx = RouteCtx {
        avg_resp_len: mean_out,
        tpot_slo: f64::INFINITY,
    };
    let r = simulate(model, &reqs, 1, RouterKind::Random, &ctx, 0);
    let mut sim = r.ttft;
    measured.sort_by(f64::total_cmp);
    sim.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let rows = [
        ("mean TTFT", mean(&measured), mean(&sim)),
        ("P50 TTFT", quantile(&measured, 0.5), quantile(&sim, 0.5)),
        ("P99 TTFT", quantile(&measured, 0.99), quantile(&sim, 0.99)),
    ];
    let mut s = format!(
        "{} requests of {} replayed on one simulated instance\n\n{:<10} {:>14} {:>15} {:>8}\n",
        reqs.len(),
        path.display(),
        "",
        "measured ms",
        "simulated ms",
        "error"
    );
    for (name, m, p) in rows {
        s.push_str(&format!(
            "{name:<10} {:>14.1} {:>15.1} {:>+7.1}%\n",
            m * 1e3,
            p * 1e3,
            (p - m) / m * 100.0
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::tests::snapshot;

    #[test]
    fn replays_a_load_report() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("load.json");
        let recs: Vec<serde_json::Value> = (0..20)
            .map(|i| {
                serde_json::json!({"model": format!("a{}", i % 3), "rank": 8, "scheduled_s": i as f64 * 0.01,
                    "prompt_tokens": 64, "output_tokens": 8, "ttft_s": 0.05, "id": i})
            })
            .collect();
        std::fs::write(&p, serde_json::json!({"requests": recs}).to_string()).unwrap();
        let (reqs, measured) = read(&p).unwrap();
        assert_eq!(reqs.len(), 20);
        assert_eq!(measured.len(), 20);
        assert_eq!(reqs.iter().map(|r| r.adapter).max(), Some(2));
        let m = InstanceModel::new(snapshot()).unwrap();
        let t = compare(&m, &p).unwrap();
        assert!(t.contains("P99 TTFT"), "{t}");
    }
}
