//! One row per (router, cluster size, adapters, popularity): the run's TTFT percentiles, SLO
//! attainment, goodput and adapter loads per second; the table `simulate` prints.
use serde::Serialize;

use super::cluster::simulate;
use super::model::InstanceModel;
use super::router::RouterKind;
use super::workload::Workload;
use super::SimulateArgs;
use crate::load::workload::PopularityKind;

/// One simulated run.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub router: RouterKind,
    pub instances: usize,
    pub adapters: usize,
    pub popularity: PopularityKind,
    pub requests: usize,
    pub finished: usize,
    /// Offered requests per second.
    pub rate: f64,
    pub p50_ttft_s: f64,
    pub p99_ttft_s: f64,
    pub ttft_slo_s: f64,
    /// Fraction of requests whose TTFT met the SLO.
    pub slo_attainment: f64,
    /// Requests per second that met the SLO (over the arrival span).
    pub goodput: f64,
    pub loads: u64,
    pub loads_per_s: f64,
    /// Whether the instances kept prefix caches.
    pub prefix_caching: bool,
    /// Prompt tokens served from the caches ÷ prompt tokens (vLLM's hits ÷ queries).
    pub prefix_hit_rate: f64,
}

/// The `q`-quantile (nearest rank) of sorted values.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let k = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[k - 1]
}

/// Every router on the same workload, in parallel threads.
pub fn run_routers(
    args: &SimulateArgs,
    model: &InstanceModel,
    w: &Workload,
    instances: usize,
    adapters: usize,
    popularity: PopularityKind,
) -> Vec<Row> {
    std::thread::scope(|s| {
        let handles: Vec<_> = args
            .routers
            .iter()
            .map(|&router| {
                s.spawn(move || {
                    let r = simulate(model, &w.reqs, instances, router, &w.ctx, args.seed);
                    let mut t = r.ttft.clone();
                    t.sort_by(f64::total_cmp);
                    let met = t.iter().filter(|x| **x <= w.ttft_slo).count();
                    let span = r.arrival_span.max(1e-9);
                    Row {
                        router,
                        instances,
                        adapters,
                        popularity,
                        requests: w.reqs.len(),
                        finished: r.finished,
                        rate: w.rate,
                        p50_ttft_s: quantile(&t, 0.5),
                        p99_ttft_s: quantile(&t, 0.99),
                        ttft_slo_s: w.ttft_slo,
                        slo_attainment: met as f64 / w.reqs.len().max(1) as f64,
                        goodput: met as f64 / span,
                        loads: r.loads,
                        loads_per_s: r.loads as f64 / r.makespan.max(1e-9),
                        prefix_caching: w.ctx.prefix_caching,
                        prefix_hit_rate: r.prefix_hits as f64 / r.prefix_queried.max(1) as f64,
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a simulation thread panicked"))
            .collect()
    })
}

fn pop_name(p: PopularityKind) -> &'static str {
    match p {
        PopularityKind::Zipf => "zipf",
        PopularityKind::RankPowerLaw => "rank-power-law",
        PopularityKind::Uniform => "uniform",
        PopularityKind::Distinct => "distinct",
        PopularityKind::Base => "base",
    }
}

/// The printed table.
pub fn table(args: &SimulateArgs, model: &InstanceModel, rows: &[Row]) -> String {
    let f = &model.snap.perf;
    let l = &model.snap.limits;
    let mut s = format!(
        "simulated instances from {} ({} layers, step = {:.3} ms + {:.4} ms/token, link {:.1} GB/s, \
         CPU {:.2} GFLOP/s, max-loras {}, max-cpu-loras {}, max-num-seqs {}); load {:.2} of capacity, \
         {} requests per instance\n\n",
        args.cost_model[0].display(),
        f.num_layers,
        f.layer_base_s * f.num_layers as f64 * 1e3,
        f.layer_per_token_s * f.num_layers as f64 * 1e3,
        f.link_gbps,
        f.cpu_flops / 1e9,
        l.max_loras,
        l.max_cpu_loras,
        l.max_num_seqs,
        args.load,
        args.requests_per_instance.unwrap_or(0),
    );
    s.push_str(&format!(
        "{:<18} {:>5} {:>9} {:>9} {:<15} {:>9} {:>12} {:>12} {:>9} {:>8} {:>11} {:>10} {:>9}\n",
        "router",
        "cache",
        "instances",
        "adapters",
        "popularity",
        "req/s",
        "P50 TTFT ms",
        "P99 TTFT ms",
        "SLO ms",
        "in SLO",
        "goodput/s",
        "loads/s",
        "hit rate"
    ));
    for r in rows {
        s.push_str(&format!(
            "{:<18} {:>5} {:>9} {:>9} {:<15} {:>9.1} {:>12.2} {:>12.2} {:>9.2} {:>7.1}% {:>11.1} {:>10.1} {:>8.1}%\n",
            r.router.name(),
            if r.prefix_caching { "on" } else { "off" },
            r.instances,
            r.adapters,
            pop_name(r.popularity),
            r.rate,
            r.p50_ttft_s * 1e3,
            r.p99_ttft_s * 1e3,
            r.ttft_slo_s * 1e3,
            r.slo_attainment * 100.0,
            r.goodput,
            r.loads_per_s,
            r.prefix_hit_rate * 100.0,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v[..1], 0.99), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
