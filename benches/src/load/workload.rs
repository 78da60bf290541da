//! The workload of a load run, planned up front from a seed so every run (and every policy of
//! `cold-start`) sends the same requests at the same offsets: arrivals (Poisson, gamma with a
//! CV knob, trace replay scaled to a rate), adapter popularity (distinct, uniform, Zipf,
//! Chameleon's rank power law) and prompt/output lengths (trace, fixed, uniform, log-normal).
use std::path::PathBuf;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Gamma, LogNormal, Zipf};
use serde::Serialize;

use crate::trace::{read_trace, TraceRow};

/// How requests arrive.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArrivalKind {
    /// Exponential inter-arrival times at --rate.
    Poisson,
    /// Gamma inter-arrival times at --rate with coefficient of variation --cv (1 = Poisson,
    /// above 1 = burstier).
    Gamma,
    /// The trace's own timestamps, time-scaled so the mean rate is --rate (the trace's native
    /// rate without --rate).
    Trace,
}

/// Which adapter each request names.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PopularityKind {
    /// The base model, no adapter.
    Base,
    /// A different adapter per request (cycling once all are used): every request is cold.
    Distinct,
    /// Uniform over the adapters.
    Uniform,
    /// Zipf(--zipf-alpha) over the adapters in the server's order.
    Zipf,
    /// Chameleon: a rank by a power law (P(i-th smallest rank) ∝ i^-α, --rank-alpha), then an
    /// adapter of that rank uniformly.
    RankPowerLaw,
}

/// Where prompt and output lengths come from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LengthKind {
    /// The trace's ContextTokens / GeneratedTokens (scaled into the context, see --length-scale).
    Trace,
    /// Exactly --prompt-len and --output-len.
    Fixed,
    /// Uniform in [(1-s)·L, (1+s)·L] with s = --length-spread.
    Uniform,
    /// Log-normal with median L and σ = --length-spread (heavy tail, like the traces).
    LogNormal,
    /// Two classes of output: long (--long-output-len ± --long-spread) with probability
    /// --long-fraction, else short (--output-len ± --length-spread); prompts --prompt-len.
    /// Head-of-line blocking's workload (issue 12: 85 % of 8–24 tokens, 15 % of 256–400).
    Bimodal,
}

/// Workload options shared by `thaw-bench load` and `thaw-bench cold-start`.
#[derive(clap::Args, Clone, Debug, Serialize)]
pub struct WorkloadArgs {
    /// Requests to send.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Arrival process.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrivals: ArrivalKind,
    /// Mean request rate, requests/s (for --arrivals trace: the target rate of the replay).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Mean offered load in tokens/s (prompt + output tokens), instead of --rate: the plan's
    /// arrival times are stretched so its tokens span tokens ÷ this, keeping the arrivals'
    /// shape and the lengths. Two seeds (two trace windows) then offer the same token load,
    /// where the same --rate can differ 2× in tokens.
    #[arg(long, conflicts_with = "rate")]
    pub token_rate: Option<f64>,
    /// Coefficient of variation of gamma inter-arrival times.
    #[arg(long, default_value_t = 2.0)]
    pub cv: f64,
    /// Adapter popularity.
    #[arg(long, value_enum, default_value = "rank-power-law")]
    pub popularity: PopularityKind,
    /// For --popularity distinct: the first request takes the adapter at this index of the
    /// server's order (`GET /v1/models`), the next ones those after it, so two passes can
    /// use disjoint adapters (e.g. ones in the host tier, then ones on disk).
    #[arg(long, default_value_t = 0)]
    pub first_adapter: usize,
    /// Zipf exponent for --popularity zipf.
    #[arg(long, default_value_t = 1.0)]
    pub zipf_alpha: f64,
    /// Power-law exponent over ranks for --popularity rank-power-law.
    #[arg(long, default_value_t = 1.0)]
    pub rank_alpha: f64,
    /// Prompt/output length source.
    #[arg(long, value_enum, default_value = "fixed")]
    pub lengths: LengthKind,
    /// Prompt tokens (median for uniform/log-normal).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Output tokens, forced with ignore_eos + max_tokens (median for uniform/log-normal).
    #[arg(long, default_value_t = 32)]
    pub output_len: usize,
    /// Spread of --lengths uniform (fraction) and log-normal (σ).
    #[arg(long, default_value_t = 0.5)]
    pub length_spread: f64,
    /// Share of long requests for --lengths bimodal.
    #[arg(long, default_value_t = 0.15)]
    pub long_fraction: f64,
    /// Median output of the long requests of --lengths bimodal.
    #[arg(long, default_value_t = 328)]
    pub long_output_len: usize,
    /// Spread (fraction) of the long outputs of --lengths bimodal.
    #[arg(long, default_value_t = 0.22)]
    pub long_spread: f64,
    /// Azure trace CSV for --arrivals trace and --lengths trace.
    #[arg(
        long,
        default_value = "../shared/traces/AzureLLMInferenceTrace_conv.csv"
    )]
    pub trace: PathBuf,
    /// Factor on trace lengths [default: fit the longest trace request into the context].
    #[arg(long)]
    pub length_scale: Option<f64>,
    /// Seed of every random choice of the plan.
    #[arg(long, default_value_t = 2023)]
    pub seed: u64,
}

impl Default for WorkloadArgs {
    fn default() -> Self {
        Self {
            requests: 200,
            arrivals: ArrivalKind::Poisson,
            rate: None,
            token_rate: None,
            cv: 2.0,
            popularity: PopularityKind::RankPowerLaw,
            first_adapter: 0,
            zipf_alpha: 1.0,
            rank_alpha: 1.0,
            lengths: LengthKind::Fixed,
            prompt_len: 128,
            output_len: 32,
            length_spread: 0.5,
            long_fraction: 0.15,
            long_output_len: 328,
            long_spread: 0.22,
            trace: PathBuf::from("../shared/traces/AzureLLMInferenceTrace_conv.csv"),
            length_scale: None,
            seed: 2023,
        }
    }
}

/// An adapter the server offers (from `GET /v1/models`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AdapterInfo {
    pub name: String,
    pub rank: Option<usize>,
}

/// What the plan needs to know about the server.
#[derive(Clone, Debug, Serialize)]
pub struct ServerInfo {
    pub base_model: String,
    /// The base model's `root` (Thaw: its directory), to find a tokenizer next to it.
    pub base_root: Option<String>,
    pub max_model_len: Option<usize>,
    pub adapters: Vec<AdapterInfo>,
}

/// One request of the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlannedRequest {
    pub id: usize,
    /// Seconds after the run starts.
    pub at_s: f64,
    /// Index into `ServerInfo::adapters`; None: the base model.
    pub adapter: Option<usize>,
    pub prompt_len: usize,
    pub output_len: usize,
}

/// Default request rate when none is given and the arrivals need one.
pub const DEFAULT_RATE: f64 = 4.0;

/// Plans `args.requests` requests against `server`.
pub fn plan(args: &WorkloadArgs, server: &ServerInfo) -> anyhow::Result<Vec<PlannedRequest>> {
    let n = args.requests;
    anyhow::ensure!(n > 0, "--requests must be at least 1");
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let needs_trace = args.arrivals == ArrivalKind::Trace || args.lengths == LengthKind::Trace;
    let trace: Vec<TraceRow> = if needs_trace {
        read_trace(&args.trace).with_context(|| {
            "--arrivals trace / --lengths trace need a trace; pass --trace FILE".to_string()
        })?
    } else {
        Vec::new()
    };
    // Trace replay takes a window of consecutive rows from a seeded start; trace lengths
    // without trace arrivals sample rows.
    let window: Vec<TraceRow> = if needs_trace {
        let start = if trace.len() > n {
            rng.random_range(0..=trace.len() - n)
        } else {
            0
        };
        (0..n).map(|i| trace[(start + i) % trace.len()]).collect()
    } else {
        Vec::new()
    };
    let mut arrivals = match args.token_rate {
        // At rate 1 first: every arrival process scales exactly with 1/rate, and the random
        // draws stay in the order a --rate plan makes them.
        Some(_) => arrivals(
            &WorkloadArgs {
                rate: Some(1.0),
                ..args.clone()
            },
            &window,
            &mut rng,
        )?,
        None => arrivals(args, &window, &mut rng)?,
    };
    let adapters = popularity(args, server, n, &mut rng)?;
    let lengths = lengths(args, server, &window, &mut rng)?;
    if let Some(tr) = args.token_rate {
        let rate = request_rate_for_tokens(tr, &lengths)?;
        arrivals.iter_mut().for_each(|t| *t /= rate);
    }
    Ok((0..n)
        .map(|i| PlannedRequest {
            id: i,
            at_s: arrivals[i],
            adapter: adapters[i],
            prompt_len: lengths[i].0,
            output_len: lengths[i].1,
        })
        .collect())
}

/// The request rate at which requests of `lengths` (prompt, output) offer `token_rate` tokens/s
/// on average: token_rate × requests ÷ tokens.
pub fn request_rate_for_tokens(token_rate: f64, lengths: &[(usize, usize)]) -> anyhow::Result<f64> {
    anyhow::ensure!(
        token_rate.is_finite() && token_rate > 0.0,
        "--token-rate must be positive, got {token_rate}"
    );
    let tokens: usize = lengths.iter().map(|(p, o)| p + o).sum();
    Ok(token_rate * lengths.len() as f64 / tokens.max(1) as f64)
}

fn arrivals(
    args: &WorkloadArgs,
    window: &[TraceRow],
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<Vec<f64>> {
    let n = args.requests;
    if let Some(r) = args.rate {
        anyhow::ensure!(r.is_finite() && r > 0.0, "--rate must be positive, got {r}");
    }
    let rate = args.rate.unwrap_or(DEFAULT_RATE);
    let gaps: Vec<f64> = match args.arrivals {
        ArrivalKind::Poisson => {
            let exp = Exp::new(rate).context("--rate")?;
            (0..n).map(|_| exp.sample(rng)).collect()
        }
        ArrivalKind::Gamma => {
            anyhow::ensure!(
                args.cv.is_finite() && args.cv > 0.0,
                "--cv must be positive, got {}",
                args.cv
            );
            // shape k = 1/cv², scale θ = 1/(rate·k): mean 1/rate, CV = 1/√k.
            let k = 1.0 / (args.cv * args.cv);
            let g = Gamma::new(k, 1.0 / (rate * k)).context("gamma parameters")?;
            (0..n).map(|_| g.sample(rng)).collect()
        }
        ArrivalKind::Trace => {
            let t0 = window.first().map_or(0.0, |r| r.at_s);
            let span = window.last().map_or(0.0, |r| r.at_s) - t0;
            // Scale so n requests span n/rate seconds (mean rate = rate).
            let factor = match args.rate {
                Some(r) if span > 0.0 => (n as f64 / r) / span,
                _ => 1.0,
            };
            let mut at: Vec<f64> = window.iter().map(|r| (r.at_s - t0) * factor).collect();
            // Timestamps within the window are sorted; wrap-around windows are not.
            at.sort_by(f64::total_cmp);
            return Ok(at);
        }
    };
    // The first request goes at t = 0 so short runs do not idle.
    let mut t = 0.0;
    Ok(gaps
        .iter()
        .enumerate()
        .map(|(i, g)| {
            if i > 0 {
                t += g;
            }
            t
        })
        .collect())
}

fn popularity(
    args: &WorkloadArgs,
    server: &ServerInfo,
    n: usize,
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<Vec<Option<usize>>> {
    let m = server.adapters.len();
    if args.popularity == PopularityKind::Base {
        return Ok(vec![None; n]);
    }
    anyhow::ensure!(
        m > 0,
        "the server offers no adapters (GET /v1/models lists only the base model); load some \
         (--lora-dir / --lora-modules) or pass --popularity base"
    );
    Ok(match args.popularity {
        PopularityKind::Base => unreachable!("handled above"),
        PopularityKind::Distinct => (0..n).map(|i| Some((args.first_adapter + i) % m)).collect(),
        PopularityKind::Uniform => (0..n).map(|_| Some(rng.random_range(0..m))).collect(),
        PopularityKind::Zipf => {
            let z = Zipf::new(m as f64, args.zipf_alpha)
                .with_context(|| format!("--zipf-alpha {} is not valid", args.zipf_alpha))?;
            (0..n)
                .map(|_| Some((z.sample(rng) as usize).clamp(1, m) - 1))
                .collect()
        }
        PopularityKind::RankPowerLaw => {
            let groups = rank_groups(&server.adapters);
            let weights: Vec<f64> = (1..=groups.len())
                .map(|i| (i as f64).powf(-args.rank_alpha))
                .collect();
            let total: f64 = weights.iter().sum();
            (0..n)
                .map(|_| {
                    let mut u = rng.random::<f64>() * total;
                    let mut g = groups.len() - 1;
                    for (i, w) in weights.iter().enumerate() {
                        if u < *w {
                            g = i;
                            break;
                        }
                        u -= w;
                    }
                    let members = &groups[g].1;
                    Some(members[rng.random_range(0..members.len())])
                })
                .collect()
        }
    })
}

/// Adapters grouped by rank, smallest rank first (adapters of unknown rank form the last group).
pub fn rank_groups(adapters: &[AdapterInfo]) -> Vec<(Option<usize>, Vec<usize>)> {
    let mut ranks: Vec<Option<usize>> = adapters.iter().map(|a| a.rank).collect();
    ranks.sort_by_key(|r| r.unwrap_or(usize::MAX));
    ranks.dedup();
    ranks
        .into_iter()
        .map(|r| {
            let members = (0..adapters.len())
                .filter(|&i| adapters[i].rank == r)
                .collect();
            (r, members)
        })
        .collect()
}

fn lengths(
    args: &WorkloadArgs,
    server: &ServerInfo,
    window: &[TraceRow],
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<Vec<(usize, usize)>> {
    let n = args.requests;
    let ctx = server.max_model_len.unwrap_or(usize::MAX);
    anyhow::ensure!(
        args.length_spread.is_finite() && args.length_spread >= 0.0,
        "--length-spread must be non-negative"
    );
    let raw: Vec<(usize, usize)> = match args.lengths {
        LengthKind::Fixed => vec![(args.prompt_len, args.output_len); n],
        LengthKind::Trace => {
            let max_total = window
                .iter()
                .map(|r| r.prompt + r.output)
                .max()
                .unwrap_or(1)
                .max(1);
            let scale = args
                .length_scale
                .unwrap_or_else(|| (ctx as f64 / max_total as f64).min(1.0));
            anyhow::ensure!(scale > 0.0, "--length-scale must be positive");
            window
                .iter()
                .map(|r| {
                    (
                        (r.prompt as f64 * scale).round() as usize,
                        (r.output as f64 * scale).round() as usize,
                    )
                })
                .collect()
        }
        LengthKind::Uniform => {
            let s = args.length_spread.min(1.0);
            let mut draw = |l: usize| {
                let lo = ((1.0 - s) * l as f64).round() as usize;
                let hi = ((1.0 + s) * l as f64).round() as usize;
                rng.random_range(lo..=hi.max(lo))
            };
            (0..n)
                .map(|_| (draw(args.prompt_len), draw(args.output_len)))
                .collect()
        }
        LengthKind::Bimodal => {
            anyhow::ensure!(
                (0.0..=1.0).contains(&args.long_fraction),
                "--long-fraction must be within [0, 1]"
            );
            (0..n)
                .map(|_| {
                    let (l, s) = if rng.random::<f64>() < args.long_fraction {
                        (args.long_output_len, args.long_spread)
                    } else {
                        (args.output_len, args.length_spread)
                    };
                    let s = s.clamp(0.0, 1.0);
                    let lo = ((1.0 - s) * l as f64).round() as usize;
                    let hi = ((1.0 + s) * l as f64).round() as usize;
                    (args.prompt_len, rng.random_range(lo..=hi.max(lo)))
                })
                .collect()
        }
        LengthKind::LogNormal => {
            let ln = LogNormal::new(0.0, args.length_spread).context("--length-spread")?;
            (0..n)
                .map(|_| {
                    let a = (args.prompt_len as f64 * ln.sample(rng)).round() as usize;
                    let b = (args.output_len as f64 * ln.sample(rng)).round() as usize;
                    (a, b)
                })
                .collect()
        }
    };
    // Every request needs one prompt and one output token, and must fit the context.
    Ok(raw
        .into_iter()
        .map(|(p, o)| {
            let p = p.clamp(1, ctx.saturating_sub(1).max(1));
            let o = o.clamp(1, ctx.saturating_sub(p).max(1));
            (p, o)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(ranks: &[usize]) -> ServerInfo {
        ServerInfo {
            base_model: "base".into(),
            base_root: None,
            max_model_len: Some(512),
            adapters: ranks
                .iter()
                .enumerate()
                .map(|(i, &r)| AdapterInfo {
                    name: format!("a{i}"),
                    rank: Some(r),
                })
                .collect(),
        }
    }

    fn args(n: usize) -> WorkloadArgs {
        WorkloadArgs {
            requests: n,
            rate: Some(10.0),
            ..Default::default()
        }
    }

    #[test]
    fn plans_are_reproducible_and_poisson_hits_the_rate() {
        let s = server(&[8, 16]);
        let a = plan(&args(4000), &s).unwrap();
        assert_eq!(a, plan(&args(4000), &s).unwrap());
        let rate = 3999.0 / a.last().unwrap().at_s;
        assert!((rate - 10.0).abs() < 0.6, "{rate}");
        assert!(a.windows(2).all(|w| w[1].at_s >= w[0].at_s));
    }

    #[test]
    fn gamma_has_the_asked_cv() {
        let a = plan(
            &WorkloadArgs {
                arrivals: ArrivalKind::Gamma,
                cv: 3.0,
                ..args(20_000)
            },
            &server(&[8]),
        )
        .unwrap();
        let gaps: Vec<f64> = a.windows(2).map(|w| w[1].at_s - w[0].at_s).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.1).abs() < 0.01, "{mean}");
        assert!(
            (var.sqrt() / mean - 3.0).abs() < 0.4,
            "{}",
            var.sqrt() / mean
        );
    }

    #[test]
    fn rank_power_law_prefers_small_ranks_and_is_uniform_within() {
        // Two adapters of each rank, listed out of order.
        let s = server(&[128, 8, 64, 16, 32, 8, 16, 32, 64, 128]);
        let p = plan(
            &WorkloadArgs {
                rank_alpha: 1.0,
                ..args(30_000)
            },
            &s,
        )
        .unwrap();
        let mut by_rank = std::collections::BTreeMap::<usize, usize>::new();
        let mut by_adapter = vec![0usize; s.adapters.len()];
        for r in &p {
            let a = r.adapter.unwrap();
            by_adapter[a] += 1;
            *by_rank.entry(s.adapters[a].rank.unwrap()).or_default() += 1;
        }
        // P(rank i) ∝ 1/i over 5 ranks: 1/H5 = 0.438 for rank 8, 0.0876 for rank 128.
        let f = |r: usize| by_rank[&r] as f64 / 30_000.0;
        assert!((f(8) - 0.438).abs() < 0.02, "{}", f(8));
        assert!((f(128) - 0.0876).abs() < 0.01, "{}", f(128));
        assert!(f(8) > f(16) && f(16) > f(32) && f(32) > f(64) && f(64) > f(128));
        let (a, b) = (by_adapter[1] as f64, by_adapter[5] as f64);
        assert!((a / b - 1.0).abs() < 0.1, "rank-8 adapters {a} vs {b}");
    }

    #[test]
    fn distinct_zipf_and_base() {
        let s = server(&[8, 8, 8, 8]);
        let d = plan(
            &WorkloadArgs {
                popularity: PopularityKind::Distinct,
                ..args(6)
            },
            &s,
        )
        .unwrap();
        let ids: Vec<_> = d.iter().map(|r| r.adapter.unwrap()).collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 0, 1]);
        let from = plan(
            &WorkloadArgs {
                popularity: PopularityKind::Distinct,
                first_adapter: 3,
                ..args(6)
            },
            &s,
        )
        .unwrap();
        let ids: Vec<_> = from.iter().map(|r| r.adapter.unwrap()).collect();
        assert_eq!(ids, vec![3, 0, 1, 2, 3, 0]);
        let z = plan(
            &WorkloadArgs {
                popularity: PopularityKind::Zipf,
                ..args(5000)
            },
            &s,
        )
        .unwrap();
        let first = z.iter().filter(|r| r.adapter == Some(0)).count();
        let last = z.iter().filter(|r| r.adapter == Some(3)).count();
        assert!(first > 3 * last, "{first} vs {last}");
        let b = plan(
            &WorkloadArgs {
                popularity: PopularityKind::Base,
                ..args(3)
            },
            &server(&[]),
        )
        .unwrap();
        assert!(b.iter().all(|r| r.adapter.is_none()));
        let e = plan(&args(3), &server(&[])).unwrap_err().to_string();
        assert!(e.contains("no adapters"), "{e}");
    }

    #[test]
    fn bimodal_lengths_mix_two_classes_at_the_fraction() {
        let plan = plan(
            &WorkloadArgs {
                lengths: LengthKind::Bimodal,
                prompt_len: 64,
                output_len: 16,
                ..args(2000)
            },
            &server(&[8]),
        )
        .unwrap();
        let long = plan.iter().filter(|p| p.output_len >= 256).count();
        assert!(plan
            .iter()
            .all(|p| (8..=24).contains(&p.output_len) || (256..=400).contains(&p.output_len)));
        assert!(
            (240..=360).contains(&long),
            "{long} of 2000 long, want ~300"
        );
    }

    #[test]
    fn lengths_fit_the_context() {
        let p = plan(
            &WorkloadArgs {
                lengths: LengthKind::LogNormal,
                prompt_len: 300,
                output_len: 300,
                length_spread: 1.5,
                ..args(500)
            },
            &server(&[8]),
        )
        .unwrap();
        assert!(p
            .iter()
            .all(|r| r.prompt_len >= 1 && r.output_len >= 1 && r.prompt_len + r.output_len <= 512));
    }

    /// A trace file of 400 rows whose lengths vary a lot from one window to the next.
    fn uneven_trace(dir: &std::path::Path) -> PathBuf {
        let t = dir.join("t.csv");
        let mut s = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
        for i in 0..400 {
            let prompt = if (i / 50) % 2 == 0 {
                20 + i % 7
            } else {
                300 + 11 * (i % 5)
            };
            s.push_str(&format!(
                "2023-11-16 18:{:02}:{:02}.{:03},{prompt},{}\n",
                i / 60,
                i % 60,
                (i * 37) % 1000,
                5 + i % 9
            ));
        }
        std::fs::write(&t, s).unwrap();
        t
    }

    proptest::proptest! {
        /// With --token-rate every seed's window offers the same tokens per second of its span,
        /// keeps the arrivals' shape and lengths of a --rate plan, and the adapters drawn.
        #[test]
        fn token_rate_offers_equal_tokens_per_second(seed in 0u64..1000, tr in 100.0f64..5000.0,
            arrivals in proptest::sample::select(vec![ArrivalKind::Trace, ArrivalKind::Poisson, ArrivalKind::Gamma])) {
            let dir = tempfile::tempdir().unwrap();
            let base = WorkloadArgs {
                arrivals,
                lengths: LengthKind::Trace,
                trace: uneven_trace(dir.path()),
                seed,
                ..args(60)
            };
            let s = server(&[8, 16, 32]);
            let by_tokens = plan(&WorkloadArgs { rate: None, token_rate: Some(tr), ..base.clone() }, &s).unwrap();
            let by_requests = plan(&base, &s).unwrap();
            let tokens: usize = by_tokens.iter().map(|r| r.prompt_len + r.output_len).sum();
            let n = by_tokens.len() as f64;
            // The request rate the token rate implies offers tr tokens/s on average.
            let rate = request_rate_for_tokens(tr, &by_tokens.iter().map(|r| (r.prompt_len, r.output_len)).collect::<Vec<_>>()).unwrap();
            proptest::prop_assert!((rate * tokens as f64 / n - tr).abs() < 1e-6 * tr);
            for (a, b) in by_tokens.iter().zip(&by_requests) {
                proptest::prop_assert_eq!((a.adapter, a.prompt_len, a.output_len), (b.adapter, b.prompt_len, b.output_len));
                // Same shape: times scale by (--rate ÷ implied rate).
                let want = b.at_s * 10.0 / rate;
                proptest::prop_assert!((a.at_s - want).abs() <= 1e-9 * want.max(1.0), "{} vs {}", a.at_s, want);
            }
            if arrivals == ArrivalKind::Trace {
                // The replay's span is exactly n ÷ rate: tokens per second of span = tr.
                let span = by_tokens.last().unwrap().at_s;
                proptest::prop_assert!((tokens as f64 / span - tr).abs() < 1e-6 * tr);
            }
        }
    }

    #[test]
    fn token_rate_evens_out_windows_of_different_weight() {
        let dir = tempfile::tempdir().unwrap();
        let base = WorkloadArgs {
            arrivals: ArrivalKind::Trace,
            lengths: LengthKind::Trace,
            trace: uneven_trace(dir.path()),
            length_scale: Some(1.0),
            ..args(50)
        };
        let s = server(&[8]);
        let per_second = |w: &WorkloadArgs| {
            let p = plan(w, &s).unwrap();
            let t: usize = p.iter().map(|r| r.prompt_len + r.output_len).sum();
            t as f64 / p.last().unwrap().at_s
        };
        // Two seeds whose windows differ in tokens: at one --rate their token loads differ,
        // at one --token-rate they do not.
        let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
        let (mut tlo, mut thi) = (f64::INFINITY, 0.0f64);
        for seed in 0..20 {
            let r = per_second(&WorkloadArgs {
                seed,
                ..base.clone()
            });
            (lo, hi) = (lo.min(r), hi.max(r));
            let t = per_second(&WorkloadArgs {
                seed,
                rate: None,
                token_rate: Some(2000.0),
                ..base.clone()
            });
            (tlo, thi) = (tlo.min(t), thi.max(t));
        }
        assert!(
            hi / lo > 1.5,
            "the windows should differ in weight: {lo}..{hi}"
        );
        assert!((thi / tlo - 1.0).abs() < 1e-9, "{tlo}..{thi}");
        assert!((tlo - 2000.0).abs() < 1e-6, "{tlo}");
    }

    #[test]
    fn trace_replay_is_scaled_to_the_rate() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.csv");
        let mut s = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
        for i in 0..100 {
            s.push_str(&format!(
                "2023-11-16 18:00:{:02}.000,{},{}\n",
                i / 2,
                1000 + i,
                10
            ));
        }
        std::fs::write(&t, s).unwrap();
        let p = plan(
            &WorkloadArgs {
                arrivals: ArrivalKind::Trace,
                lengths: LengthKind::Trace,
                trace: t,
                rate: Some(20.0),
                ..args(100)
            },
            &server(&[8]),
        )
        .unwrap();
        // 100 requests over 49.5 s of trace, replayed at 20 req/s: 5 s.
        assert!((p.last().unwrap().at_s - 5.0).abs() < 1e-9);
        // Lengths scaled so the longest (1099 + 10) fits the 512-token context.
        assert!(p.iter().all(|r| r.prompt_len + r.output_len <= 512));
        assert!(p.iter().any(|r| r.prompt_len > 400));
    }
}
