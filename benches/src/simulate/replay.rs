//! `--replay load.json`: the requests a `thaw-bench load` run sent (its send times, adapters,
//! prompt and output lengths, and which of its `--url`s each went to: round-robin), simulated
//! on as many instances routed the same way, each modelled by the cost model its own server
//! dumped, next to the TTFT the run measured — the simulator's error against the real servers.
use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

use super::cluster::{simulate_timeline, Timeline};
use super::instance::SimRequest;
use super::model::InstanceModel;
use super::report::quantile;
use super::router::{RouteCtx, RouterKind};
use thaw_server::coldstart::CostSnapshot;

#[derive(Deserialize)]
struct LoadFile {
    requests: Vec<Record>,
}

/// One server's cost model as the replay uses it: one snapshot for the whole run, or the
/// history `thaw serve --dump-cost-model` appended (`*.history.jsonl`), each snapshot ruling the
/// steps between the previous one's writing and its own.
pub struct ServerModel {
    /// `(from, model)`: from −∞ for a single snapshot; from Unix seconds for a history.
    points: Vec<(f64, InstanceModel)>,
    history: bool,
}

impl ServerModel {
    /// One snapshot for the whole run.
    pub fn fixed(m: InstanceModel) -> Self {
        Self {
            points: vec![(f64::NEG_INFINITY, m)],
            history: false,
        }
    }

    /// A history: `(written Unix seconds, model)`, oldest first, not empty; each model rules
    /// from the previous one's writing.
    pub fn history(snaps: Vec<(f64, InstanceModel)>) -> Self {
        let mut from = f64::NEG_INFINITY;
        let points = snaps
            .into_iter()
            .map(|(w, m)| (std::mem::replace(&mut from, w), m))
            .collect();
        Self {
            points,
            history: true,
        }
    }

    /// Reads a `--dump-cost-model` file, or its history if the name ends in `.jsonl`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        if path.extension().is_some_and(|e| e == "jsonl") {
            let snaps = CostSnapshot::read_history(path)?;
            anyhow::ensure!(!snaps.is_empty(), "{} holds no cost model", path.display());
            let h = snaps
                .into_iter()
                .map(|s| Ok((s.written_unix_s, InstanceModel::new(s)?)))
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok(Self::history(h))
        } else {
            Ok(Self::fixed(InstanceModel::new(CostSnapshot::read(path)?)?))
        }
    }

    /// Its points on the run's clock (seconds after `run_start_unix`).
    fn points(&self, run_start_unix: Option<f64>) -> anyhow::Result<Vec<(f64, InstanceModel)>> {
        let t0 = match (self.history, run_start_unix) {
            (false, _) => 0.0,
            (true, Some(t0)) => t0,
            (true, None) => anyhow::bail!(
                "the load report has no send times (sent_unix_s) to line the cost-model \
                 history up with; rerun `thaw-bench load` with this build"
            ),
        };
        Ok(self
            .points
            .iter()
            .map(|(t, m)| (t - t0, m.clone()))
            .collect())
    }
}

#[derive(Deserialize)]
struct Record {
    /// Index of the server it went to (older reports: one server).
    #[serde(default)]
    instance: usize,
    model: String,
    rank: Option<usize>,
    scheduled_s: f64,
    #[serde(default)]
    sent_s: f64,
    /// Absent in older reports.
    #[serde(default)]
    sent_unix_s: Option<f64>,
    prompt_tokens: usize,
    output_tokens: usize,
    ttft_s: Option<f64>,
}

/// A replayed request: where it went, what it was, what its TTFT measured.
#[derive(Clone, Copy, Debug)]
pub struct Replayed {
    pub instance: usize,
    pub req: SimRequest,
    pub ttft: f64,
}

/// Reads the successful requests of a `thaw-bench load` report, in send order, and the Unix
/// time of the run's start when the report has it.
pub fn read(path: &Path) -> anyhow::Result<(Vec<Replayed>, Option<f64>)> {
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
    let start = recs[0].sent_unix_s.map(|u| u - recs[0].sent_s);
    let mut out = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let n = ids.len() as u32;
        let adapter = *ids.entry(r.model.clone()).or_insert(n);
        out.push(Replayed {
            instance: r.instance,
            req: SimRequest {
                id: i,
                at: r.scheduled_s,
                adapter,
                rank: r.rank.unwrap_or(0) as u32,
                prompt: r.prompt_tokens.max(1),
                output: r.output_tokens.max(1),
                chat: None,
                after: None,
            },
            ttft: r.ttft_s.unwrap_or_default(),
        });
    }
    Ok((out, start))
}

/// Simulated TTFT of every replayed request, in `replayed` order: each instance's requests on
/// one simulated instance of `models[instance]` (a static router: instances do not interact).
pub fn simulate_routed(
    models: &[ServerModel],
    replayed: &[Replayed],
    run_start_unix: Option<f64>,
) -> anyhow::Result<Vec<f64>> {
    let n = replayed.iter().map(|r| r.instance + 1).max().unwrap_or(1);
    anyhow::ensure!(
        models.len() == n || models.len() == 1,
        "the load report used {n} servers; pass one --cost-model for all or one per server ({} given)",
        models.len()
    );
    let mut ttft = vec![f64::NAN; replayed.len()];
    for i in 0..n {
        let points = models[i.min(models.len() - 1)].points(run_start_unix)?;
        let idx: Vec<usize> = (0..replayed.len())
            .filter(|&k| replayed[k].instance == i)
            .collect();
        let reqs: Vec<SimRequest> = idx
            .iter()
            .enumerate()
            .map(|(j, &k)| SimRequest {
                id: j,
                ..replayed[k].req
            })
            .collect();
        if reqs.is_empty() {
            continue;
        }
        let mean_out = reqs.iter().map(|r| r.output as f64).sum::<f64>() / reqs.len() as f64;
        let ctx = RouteCtx {
            avg_resp_len: mean_out,
            tpot_slo: f64::INFINITY,
            prefix_caching: false,
        };
        let timeline = Timeline::new(&points);
        for (j, t) in simulate_timeline(timeline, &reqs, 1, RouterKind::Random, &ctx, 0).ttft_by_id
        {
            ttft[idx[j]] = t;
        }
    }
    Ok(ttft)
}

/// The comparison table: measured vs simulated mean, P50 and P99 TTFT.
pub fn compare(models: &[ServerModel], path: &Path) -> anyhow::Result<String> {
    let (replayed, start) = read(path)?;
    let sim = simulate_routed(models, &replayed, start)?;
    let mut measured: Vec<f64> = replayed.iter().map(|r| r.ttft).collect();
    let mut sim_sorted = sim.clone();
    measured.sort_by(f64::total_cmp);
    sim_sorted.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let rows = [
        ("mean TTFT", mean(&measured), mean(&sim_sorted)),
        (
            "P50 TTFT",
            quantile(&measured, 0.5),
            quantile(&sim_sorted, 0.5),
        ),
        (
            "P99 TTFT",
            quantile(&measured, 0.99),
            quantile(&sim_sorted, 0.99),
        ),
    ];
    let instances = replayed.iter().map(|r| r.instance + 1).max().unwrap_or(1);
    let mut s = format!(
        "{} requests of {} replayed on {instances} simulated instance(s), routed as the run routed them\n\n{:<10} {:>14} {:>15} {:>8}\n",
        replayed.len(),
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
        let (replayed, start) = read(&p).unwrap();
        assert_eq!(start, None);
        assert_eq!(replayed.len(), 20);
        assert!(replayed.iter().all(|r| r.ttft == 0.05 && r.instance == 0));
        assert_eq!(replayed.iter().map(|r| r.req.adapter).max(), Some(2));
        let m = ServerModel::fixed(InstanceModel::new(snapshot()).unwrap());
        let t = compare(std::slice::from_ref(&m), &p).unwrap();
        assert!(t.contains("P99 TTFT"), "{t}");
        assert!(t.contains("1 simulated instance"), "{t}");
    }

    /// Requests the run sent to two servers, alternately: replayed on two instances, every
    /// request gets a TTFT, and each instance queues only its half (no later than on one).
    #[test]
    fn replays_two_routed_servers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("load.json");
        let recs: Vec<serde_json::Value> = (0..40)
            .map(|i| {
                serde_json::json!({"instance": i % 2, "model": format!("a{}", i % 3), "rank": 16,
                    "scheduled_s": i as f64 * 0.001, "prompt_tokens": 200, "output_tokens": 8,
                    "ttft_s": 0.5})
            })
            .collect();
        std::fs::write(&p, serde_json::json!({"requests": recs}).to_string()).unwrap();
        let (replayed, _) = read(&p).unwrap();
        let m = || ServerModel::fixed(InstanceModel::new(snapshot()).unwrap());
        let two = simulate_routed(&[m(), m()], &replayed, None).unwrap();
        assert!(two.iter().all(|t| t.is_finite() && *t > 0.0), "{two:?}");
        let mut one_inst = replayed.clone();
        one_inst.iter_mut().for_each(|r| r.instance = 0);
        let one = simulate_routed(&[m()], &one_inst, None).unwrap();
        let sum = |v: &[f64]| v.iter().sum::<f64>();
        assert!(sum(&two) < sum(&one), "two {} one {}", sum(&two), sum(&one));
        let e = simulate_routed(&[m(), m(), m()], &replayed, None).unwrap_err();
        assert!(e.to_string().contains("one per server"), "{e}");
        let t = compare(&[m()], &p).unwrap();
        assert!(t.contains("2 simulated instance"), "{t}");
        // A history needs the run's clock, which this report lacks.
        let h = ServerModel::history(vec![(0.0, InstanceModel::new(snapshot()).unwrap())]);
        let e = simulate_routed(&[h], &replayed, None).unwrap_err();
        assert!(e.to_string().contains("sent_unix_s"), "{e}");
        // Each snapshot rules from the previous one's writing, on the run's clock.
        let h = ServerModel::history(vec![
            (100.0, InstanceModel::new(snapshot()).unwrap()),
            (110.0, InstanceModel::new(snapshot()).unwrap()),
        ]);
        let at: Vec<f64> = h.points(Some(95.0)).unwrap().iter().map(|p| p.0).collect();
        assert_eq!(at, vec![f64::NEG_INFINITY, 5.0]);
    }
}
