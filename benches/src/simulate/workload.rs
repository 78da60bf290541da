//! A simulated run's requests: Azure trace arrivals (tiled past the trace's end, time-scaled
//! to the offered rate), trace lengths fitted to the context, and adapters drawn by the load
//! generator's popularity models (`load::workload`) over 1,000 … 1,000,000 adapters; or
//! multi-turn chat (`--workload multi-turn`, `thaw-bench load --multi-turn`'s shape):
//! conversations starting as a Poisson process, each turn sent a think time after the
//! previous answer, with its adapter's system prompt and the earlier turns in its prompt.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};

use super::instance::SimRequest;
use super::model::InstanceModel;
use super::prefix::ChatTurn;
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
    let rate = offered_rate(model, args.load, instances, mean_prompt, mean_output);
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
                chat: None,
                after: None,
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
            prefix_caching: false,
        },
    })
}

/// Requests a cluster of `instances` can serve per second at `load` of its capacity, for
/// requests of these mean lengths (prefill at the per-token rate, decode in full batches;
/// no prefix cache).
fn offered_rate(
    model: &InstanceModel,
    load: f64,
    instances: usize,
    mean_prompt: f64,
    mean_output: f64,
) -> f64 {
    let l = model.snap.limits;
    let full = l.max_num_seqs as f64;
    let service = model.base_step_time(mean_prompt.round() as usize)
        + mean_output * model.base_step_time(l.max_num_seqs) / full;
    load * instances as f64 / service
}

/// Multi-turn chat on `instances` instances: `--requests-per-instance` × instances turns in
/// conversations of `--turns`; a conversation's adapter is drawn by `pop`, its turns carry
/// the adapter's `--system-prompt-len` system prompt, `--user-len` new tokens and the earlier
/// `--answer-len` answers. Conversations start at the rate that offers `--load` of the
/// cluster's capacity (without prefix caching, so caching on and off see the same load).
pub fn build_chat(
    args: &SimulateArgs,
    model: &InstanceModel,
    server: &ServerInfo,
    pop: PopularityKind,
    instances: usize,
) -> anyhow::Result<Workload> {
    let turns = args.turns.max(1);
    let n = args.requests_per_instance.unwrap_or(50).max(1) * instances;
    let convs = n.div_ceil(turns);
    let wargs = WorkloadArgs {
        requests: convs,
        arrivals: ArrivalKind::Poisson,
        popularity: pop,
        zipf_alpha: args.zipf_alpha,
        rank_alpha: args.rank_alpha,
        lengths: LengthKind::Fixed,
        seed: args.seed ^ instances as u64,
        ..WorkloadArgs::default()
    };
    let adapters: Vec<usize> = plan(&wargs, server)?
        .iter()
        .map(|p| p.adapter.unwrap_or(0))
        .collect();
    let (sys, user, answer) = (
        args.system_prompt_len as u32,
        args.user_len.max(1) as u32,
        args.answer_len.max(1) as u32,
    );
    // Mean prompt over the turns: the system prompt, half the earlier exchanges, a message.
    let mean_prompt = sys as f64 + (turns - 1) as f64 / 2.0 * (user + answer) as f64 + user as f64;
    let rate = offered_rate(model, args.load, instances, mean_prompt, answer as f64);
    let conv_rate = rate / turns as f64;
    let mut rng = ChaCha8Rng::seed_from_u64(wargs.seed ^ 0xC0_4E);
    let gap = Exp::new(conv_rate).map_err(|e| anyhow::anyhow!("conversation rate: {e}"))?;
    let think = (args.think_time > 0.0)
        .then(|| Exp::new(1.0 / args.think_time))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--think-time: {e}"))?;
    let mut reqs = Vec::with_capacity(n);
    let mut at = 0.0;
    for (c, &a) in adapters.iter().enumerate() {
        if c > 0 {
            at += gap.sample(&mut rng);
        }
        for t in 0..turns.min(n - reqs.len()) {
            let k = reqs.len();
            let chat = ChatTurn {
                conv: c as u32,
                turn: t as u32,
                system: sys,
                user,
                answer,
            };
            let after = (t > 0).then(|| (k - 1, think.map_or(0.0, |e| e.sample(&mut rng))));
            reqs.push(SimRequest {
                id: k,
                at,
                adapter: a as u32,
                rank: server.adapters[a].rank.unwrap_or(8) as u32,
                prompt: chat.prompt(),
                output: answer as usize,
                chat: Some(chat),
                after,
            });
        }
    }
    let mut prompts: Vec<usize> = reqs.iter().map(|r| r.prompt).collect();
    prompts.sort_unstable();
    let median = prompts[prompts.len() / 2];
    let l = model.snap.limits;
    Ok(Workload {
        reqs,
        rate,
        ttft_slo: args
            .ttft_slo
            .unwrap_or_else(|| 5.0 * model.base_step_time(median)),
        ctx: RouteCtx {
            avg_resp_len: answer as f64,
            tpot_slo: args
                .tpot_slo
                .unwrap_or_else(|| 1.5 * model.base_step_time(l.max_num_seqs)),
            prefix_caching: false,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::tests::snapshot;
    use crate::simulate::SimWorkload;
    use std::path::PathBuf;

    #[test]
    fn chat_turns_follow_their_conversation_and_grow() {
        let m = InstanceModel::new(snapshot()).unwrap();
        let args = SimulateArgs {
            workload: SimWorkload::MultiTurn,
            turns: 4,
            system_prompt_len: 500,
            user_len: 30,
            answer_len: 20,
            think_time: 2.0,
            prefix_caching: vec![true],
            cost_model: vec![],
            instances: vec![],
            routers: vec![],
            adapters: vec![],
            popularity: vec![],
            ranks: vec![8],
            zipf_alpha: 1.0,
            rank_alpha: 1.0,
            requests_per_instance: Some(25),
            load: 0.5,
            ttft_slo: None,
            tpot_slo: None,
            trace: PathBuf::new(),
            max_model_len: None,
            quick: false,
            out: None,
            seed: 1,
            replay: None,
        };
        let ranks = adapter_ranks(50, &[8, 16], 1);
        let server = server_info(&ranks, 4096);
        let w = build_chat(&args, &m, &server, PopularityKind::Zipf, 2).unwrap();
        // 50 turns: 12 conversations of 4 and one of 2.
        assert_eq!(w.reqs.len(), 50);
        for (k, r) in w.reqs.iter().enumerate() {
            let c = r.chat.unwrap();
            assert_eq!(r.id, k);
            assert_eq!(r.prompt, 500 + c.turn as usize * 50 + 30);
            assert_eq!(r.output, 20);
            assert_eq!(r.rank, ranks[r.adapter as usize]);
            if c.turn == 0 {
                assert!(r.after.is_none());
            } else {
                let (prev, think) = r.after.unwrap();
                assert_eq!(prev, k - 1);
                assert!(think >= 0.0);
                let p = &w.reqs[prev];
                assert_eq!((p.chat.unwrap().conv, p.adapter), (c.conv, r.adapter));
            }
        }
        assert_eq!(w.reqs.iter().filter(|r| r.after.is_none()).count(), 13);
        assert!(w.rate > 0.0 && w.ttft_slo > 0.0 && !w.ctx.prefix_caching);
    }

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
