//! A simulated run's requests: Azure trace arrivals (tiled past the trace's end, time-scaled
//! to the offered rate), trace lengths fitted to the context, and adapters drawn by the load
//! generator's popularity models (`load::workload`) over 1,000 … 1,000,000 adapters.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::instance::SimRequest;
use super::model::InstanceModel;
use super::router::RouteCtx;
use super::SimulateArgs;
use crate::load::workload::{
    plan, AdapterInfo, ArrivalKind, LengthKind, PopularityKind, ServerInfo, WorkloadArgs,
};
use crate::trace::TraceRow;

/// Everything one run needs.
#[derive(Clone, Debug)]
pub struct Workload {
    pub reqs: Vec<SimRequest>,
    /// Offered requests per second.
    pub rate: f64,
    pub ttft_slo: f64,
    pub ctx: RouteCtx,
}

/// A rank per adapter, uniformly from `ranks` (seeded).
pub fn adapter_ranks(n: usize, ranks: &[u32], seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_0F4A);
    (0..n)
        .map(|_| ranks[rng.random_range(0..ranks.len())])
        .collect()
}

/// The "server" the popularity models draw adapters from.
pub fn server_info(ranks: &[u32], max_model_len: usize) -> ServerInfo {
    ServerInfo {
        base_model: "base".into(),
        base_root: None,
        max_model_len: Some(max_model_len),
        adapters: ranks
            .iter()
            .enumerate()
            .map(|(i, &r)| AdapterInfo {
                name: format!("a{i}"),
                rank: Some(r as usize),
            })
            .collect(),
    }
}

/// `--max-model-len`, or an equal share of the KV cache among --max-num-seqs requests.
pub fn max_model_len(args: &SimulateArgs, model: &InstanceModel) -> usize {
    let l = &model.snap.limits;
    args.max_model_len
        .unwrap_or(l.kv_total_blocks * l.block_size / l.max_num_seqs.max(1))
        .max(2)
}

/// `n` arrival times from the trace starting at a seeded row, tiled end to end past its last
/// row, scaled so the mean rate is `rate`.
fn arrivals(trace: &[TraceRow], n: usize, rate: f64, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let len = trace.len();
    let span = trace.last().map_or(0.0, |r| r.at_s) - trace[0].at_s;
    // One tile lasts the trace's span plus one mean gap, so tiles do not overlap.
    let period = span + span / len.max(1) as f64;
    let start = rng.random_range(0..len);
    let raw: Vec<f64> = (0..n)
        .map(|i| {
            let k = start + i;
            trace[k % len].at_s + (k / len) as f64 * period
        })
        .collect();
    let t0 = raw[0];
    let total = raw[n - 1] - t0;
    let factor = if total > 0.0 && n > 1 {
        (n as f64 / rate) / total
    } else {
        1.0
    };
    let mut at: Vec<f64> = raw.iter().map(|t| (t - t0) * factor).collect();
    at.sort_by(f64::total_cmp);
    at
}

/// The requests of one run on `instances` instances.
pub fn build(
    args: &SimulateArgs,
    model: &InstanceModel,
    trace: &[TraceRow],
    server: &ServerInfo,
    pop: PopularityKind,
    instances: usize,
) -> anyhow::Result<Workload> {
    let per = args.requests_per_instance.unwrap_or(50).max(1);
    let n = per * instances;
    let wargs = WorkloadArgs {
        requests: n,
        arrivals: ArrivalKind::Poisson,
        popularity: pop,
        zipf_alpha: args.zipf_alpha,
        rank_alpha: args.rank_alpha,
        lengths: LengthKind::Trace,
        trace: args.trace.clone(),
        seed: args.seed ^ instances as u64,
        ..WorkloadArgs::default()
    };
    let planned = plan(&wargs, server)?;
    let mean_prompt = planned.iter().map(|p| p.prompt_len).sum::<usize>() as f64 / n as f64;
    let mean_output = planned.iter().map(|p| p.output_len).sum::<usize>() as f64 / n as f64;
    // Capacity: prefill at the per-token rate, decode in full batches (each step with the
    // loop's overhead).
    let l = model.snap.limits;
    let full = l.max_num_seqs as f64;
    let service = model.base_step_time(mean_prompt.round() as usize)
        + mean_output * model.base_step_time(l.max_num_seqs) / full;
    let rate = args.load * instances as f64 / service;
    let mut rng = ChaCha8Rng::seed_from_u64(wargs.seed);
    let at = arrivals(trace, n, rate, &mut rng);
    let reqs: Vec<SimRequest> = planned
        .iter()
        .zip(at)
        .enumerate()
        .map(|(i, (p, t))| {
            let a = p.adapter.unwrap_or(0);
            SimRequest {
                id: i,
                at: t,
                adapter: a as u32,
                rank: server.adapters[a].rank.unwrap_or(8) as u32,
                prompt: p.prompt_len,
                output: p.output_len,
            }
        })
        .collect();
    let mut prompts: Vec<usize> = reqs.iter().map(|r| r.prompt).collect();
    prompts.sort_unstable();
    let median = prompts[prompts.len() / 2];
    let ttft_slo = args
        .ttft_slo
        .unwrap_or_else(|| 5.0 * model.base_step_time(median));
    let tpot_slo = args
        .tpot_slo
        .unwrap_or_else(|| 1.5 * model.base_step_time(l.max_num_seqs));
    Ok(Workload {
        reqs,
        rate,
        ttft_slo,
        ctx: RouteCtx {
            avg_resp_len: mean_output,
            tpot_slo,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiled_arrivals_are_sorted_and_keep_the_rate() {
        let trace: Vec<TraceRow> = (0..10)
            .map(|i| TraceRow {
                at_s: (i * i) as f64,
                prompt: 1,
                output: 1,
            })
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let at = arrivals(&trace, 95, 5.0, &mut rng);
        assert_eq!(at.len(), 95);
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "{at:?}");
        assert!((at[94] - 95.0 / 5.0).abs() < 1e-9);
    }
}
