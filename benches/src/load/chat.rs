//! Chat workloads of `thaw-bench load` (issue 28), sent as messages to
//! `/v1/chat/completions` so the server applies its chat template, as chat clients do:
//!
//! - `--multi-turn`: conversations of `--turns` turns. Each adapter has its own system prompt
//!   of `--system-prompt-len` tokens; a conversation's adapter is drawn by `--popularity`
//!   (e.g. Zipf), conversations start by `--arrivals` at `--rate` ÷ turns (so the turns offer
//!   about `--rate` requests/s), and each turn is sent `--think-time` (exponential mean) after
//!   the previous answer ended, with the system prompt, every earlier user message and answer,
//!   and the new user message (`--prompt-len` tokens; `--lengths` apply per turn). A prefix
//!   cache keyed by adapter serves the system prompt and the earlier turns.
//! - `--no-max-tokens`: every request is one user message of its planned prompt length, sent
//!   without `max_tokens` (the server then allows the rest of the context, as for a chat client);
//!   the client ends the stream once the planned output has arrived, as an EOS would.
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use serde::Serialize;
use serde_json::{json, Value};

use super::client::OpenAiClient;
use super::prompts::PromptSource;
use super::runner::{unix_now, RequestRecord, RunOptions};
use super::workload::{self, ServerInfo, WorkloadArgs};

/// The chat workloads' options (flattened into `thaw-bench load`).
#[derive(clap::Args, Clone, Debug, Default, Serialize)]
pub struct ChatArgs {
    /// Multi-turn chat: conversations of --turns turns as chat messages, each adapter with its
    /// own --system-prompt-len-token system prompt, each turn carrying the earlier turns and
    /// answers; --prompt-len is each new user message. --requests counts turns.
    #[arg(long)]
    pub multi_turn: bool,
    /// Turns per conversation (--multi-turn).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Tokens of each adapter's system prompt (--multi-turn).
    #[arg(long, default_value_t = 1000)]
    pub system_prompt_len: usize,
    /// Mean seconds (exponential) between an answer and the next turn (--multi-turn).
    #[arg(long, default_value_t = 0.0)]
    pub think_time: f64,
    /// Send no max_tokens, as chat clients do (the server defaults to the rest of the
    /// context); the client ends each stream after its planned output tokens, as an EOS would.
    /// Requests go to /v1/chat/completions as one user message of the planned prompt length.
    #[arg(long)]
    pub no_max_tokens: bool,
}

impl ChatArgs {
    /// Whether a chat workload is asked for.
    pub fn any(&self) -> bool {
        self.multi_turn || self.no_max_tokens
    }

    /// A label for tables.
    pub fn label(&self) -> &'static str {
        match (self.multi_turn, self.no_max_tokens) {
            (true, true) => "multi-turn, no max_tokens",
            (true, false) => "multi-turn",
            (false, true) => "no max_tokens",
            (false, false) => "completions",
        }
    }

    /// Turns per conversation: 1 unless --multi-turn.
    pub fn turns(&self) -> usize {
        if self.multi_turn {
            self.turns
        } else {
            1
        }
    }
}

/// Tokens the chat template may add around a message (ChatML: `<|im_start|>role\n` … `<|im_end|>\n`),
/// and the generation prompt.
const TEMPLATE_SLACK: usize = 8;

/// Room to leave beside a message of `tokens` planned tokens: the template's, and the drift of
/// decoded text re-tokenized by the server (a few percent, more on long texts).
fn slack(tokens: usize) -> usize {
    TEMPLATE_SLACK + tokens / 32
}

/// A one-message request of `prompt` + `output` planned tokens, cut to fit a `ctx`-token
/// context with the template's room ([`slack`]): the prompt first down to what leaves one
/// output token, then the output to what the prompt leaves.
pub fn fit_message(prompt: usize, output: usize, ctx: usize) -> (usize, usize) {
    // The template's room grows by one token per 32, so a few dozen steps at most.
    let mut p = prompt.clamp(1, ctx.max(1));
    while p > 1 && p + slack(p) + 1 > ctx {
        p -= 1;
    }
    let o = output.min(ctx.saturating_sub(p + slack(p))).max(1);
    (p, o)
}

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Turn {
    /// Index of the request (conversation × turns + turn).
    pub id: usize,
    pub user: String,
    pub user_tokens: usize,
    pub output_len: usize,
    /// Its planned prompt or output was cut so that the message fits the server's context.
    pub clipped: bool,
    /// Wait after the previous answer, seconds (0 for the first turn).
    pub think_s: f64,
}

/// A conversation: its start, adapter, system prompt and turns.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Conversation {
    pub at_s: f64,
    pub adapter: Option<usize>,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
}

/// Plans the conversations of `w.requests` turns: the load generator's plan (arrivals,
/// adapters, lengths) at `--rate` for the turns, conversation k taking requests k·T … k·T+T−1
/// (its start and adapter from the first, each turn's lengths from its own); the last
/// conversation is shorter when T does not divide --requests.
/// `system_seed` picks the adapters' system prompts (keep it across runs: an adapter's system
/// prompt does not change), `w.seed` everything else.
pub fn plan(
    chat: &ChatArgs,
    w: &WorkloadArgs,
    server: &ServerInfo,
    prompts: &PromptSource,
    system_seed: u64,
) -> anyhow::Result<Vec<Conversation>> {
    let t = chat.turns();
    anyhow::ensure!(t >= 1, "--turns must be at least 1");
    anyhow::ensure!(
        chat.think_time.is_finite() && chat.think_time >= 0.0,
        "--think-time must be a non-negative number of seconds"
    );
    let mut planned = workload::plan(w, server)?;
    let system = chat.multi_turn && chat.system_prompt_len > 0;
    let mut clipped = vec![false; planned.len()];
    if let (1, false, Some(ctx)) = (t, system, server.max_model_len) {
        // One message: the plan fits prompt + output to the context exactly, as for token-id
        // prompts; a message also carries the chat template and re-tokenizes a little longer,
        // so clip its prompt, then its output, to leave that room (as vLLM's benchmark fits
        // its datasets to the served model's context), and count what was clipped.
        for (p, c) in planned.iter_mut().zip(&mut clipped) {
            let (prompt, output) = fit_message(p.prompt_len, p.output_len, ctx);
            *c = (prompt, output) != (p.prompt_len, p.output_len);
            (p.prompt_len, p.output_len) = (prompt, output);
        }
    }
    if let (true, Some(ctx)) = (chat.multi_turn && t > 1 || system, server.max_model_len) {
        // The last turn carries everything before it; allow the template a few tokens a message.
        let longest = planned
            .chunks(t)
            .map(|c| {
                let turns: usize = c
                    .iter()
                    .map(|p| p.prompt_len + p.output_len + slack(p.prompt_len + p.output_len))
                    .sum();
                turns
                    + if system {
                        chat.system_prompt_len + slack(chat.system_prompt_len)
                    } else {
                        0
                    }
            })
            .max()
            .unwrap_or(0);
        anyhow::ensure!(
            longest <= ctx,
            "a conversation's last turn would need {longest} tokens but the server's context is \
             {ctx}; lower --system-prompt-len, --turns, --prompt-len or --output-len"
        );
    }
    // One system prompt per adapter (index len() for the base model), the same on every run.
    let n_sys = server.adapters.len() + 1;
    let sys_texts = if system {
        prompts.texts(&vec![chat.system_prompt_len; n_sys], system_seed ^ 0x5157)
    } else {
        Vec::new()
    };
    let users = prompts.texts(
        &planned.iter().map(|p| p.prompt_len).collect::<Vec<_>>(),
        w.seed,
    );
    let think = (chat.think_time > 0.0)
        .then(|| Exp::new(1.0 / chat.think_time))
        .transpose()
        .context("--think-time")?;
    let mut rng = ChaCha8Rng::seed_from_u64(w.seed ^ 0x0074_6869_6e6b);
    let mut out = Vec::new();
    for (k, chunk) in planned.chunks(t).enumerate() {
        let first = &chunk[0];
        let system = system.then(|| {
            let i = first.adapter.unwrap_or(n_sys - 1);
            format!("You are assistant {i}. {}", sys_texts[i])
        });
        let turns = chunk
            .iter()
            .enumerate()
            .map(|(j, p)| Turn {
                id: k * t + j,
                user: users[p.id].clone(),
                user_tokens: p.prompt_len,
                output_len: p.output_len,
                clipped: clipped[k * t + j],
                think_s: match (&think, j) {
                    (Some(e), j) if j > 0 => e.sample(&mut rng),
                    _ => 0.0,
                },
            })
            .collect();
        out.push(Conversation {
            at_s: first.at_s,
            adapter: first.adapter,
            system,
            turns,
        });
    }
    Ok(out)
}

/// The messages of `conv`'s turn `j`: system prompt, the earlier turns with their answers,
/// the new user message.
pub fn messages(conv: &Conversation, answers: &[String], j: usize) -> Vec<Value> {
    let mut m = Vec::with_capacity(2 * j + 2);
    if let Some(s) = &conv.system {
        m.push(json!({"role": "system", "content": s}));
    }
    for (turn, answer) in conv.turns[..j].iter().zip(answers) {
        m.push(json!({"role": "user", "content": turn.user}));
        m.push(json!({"role": "assistant", "content": answer}));
    }
    m.push(json!({"role": "user", "content": conv.turns[j].user}));
    m
}

/// Runs every conversation open-loop (each starts at its time whatever the others do; its
/// turns follow one another). One record per planned turn, in id order; a turn after a failed
/// one is recorded as failed without being sent.
pub async fn run(
    client: &OpenAiClient,
    server: &ServerInfo,
    chat: &ChatArgs,
    convs: &[Conversation],
    opts: &RunOptions,
) -> (Vec<RequestRecord>, Duration) {
    let total: usize = convs.iter().map(|c| c.turns.len()).sum();
    let bar = if opts.progress {
        let b = ProgressBar::new(total as u64);
        b.set_style(
            ProgressStyle::with_template("{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} done")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_prefix(opts.label.clone());
        b
    } else {
        ProgressBar::hidden()
    };
    let start = tokio::time::Instant::now();
    let t0 = Instant::now();
    let no_max = chat.no_max_tokens;
    let system_len = chat.system_prompt_len;
    let mut tasks = Vec::with_capacity(convs.len());
    for conv in convs {
        let (client, bar, conv) = (client.clone(), bar.clone(), Arc::new(conv.clone()));
        let (model, rank) = match conv.adapter {
            Some(i) => (server.adapters[i].name.clone(), server.adapters[i].rank),
            None => (server.base_model.clone(), None),
        };
        let timeout = opts.request_timeout;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(conv.at_s)).await;
            let mut answers: Vec<String> = Vec::new();
            // The prompt's planned tokens, for a turn whose usage never arrived (a stream
            // the client ended): the system prompt and every earlier message.
            let mut planned = conv.system.as_ref().map_or(0, |_| system_len);
            let mut records = Vec::with_capacity(conv.turns.len());
            let mut failed: Option<String> = None;
            for (j, turn) in conv.turns.iter().enumerate() {
                let record = |sent_s: f64, sent_unix_s: f64, error: Option<String>| RequestRecord {
                    id: turn.id,
                    instance: 0,
                    model: model.clone(),
                    rank,
                    scheduled_s: sent_s,
                    sent_s,
                    sent_unix_s,
                    prompt_tokens: turn.user_tokens,
                    cached_tokens: None,
                    max_tokens: turn.output_len,
                    output_tokens: 0,
                    ttft_s: None,
                    tpot_s: None,
                    e2e_s: None,
                    error,
                };
                if let Some(e) = &failed {
                    records.push(record(
                        t0.elapsed().as_secs_f64(),
                        0.0,
                        Some(format!("not sent: {e}")),
                    ));
                    bar.inc(1);
                    continue;
                }
                if turn.think_s > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(turn.think_s)).await;
                }
                let msgs = messages(&conv, &answers, j);
                let sent_s = t0.elapsed().as_secs_f64();
                let sent_unix_s = unix_now();
                let (max_tokens, stop_after) = if no_max {
                    (None, Some(turn.output_len))
                } else {
                    (Some(turn.output_len), None)
                };
                let t = client
                    .stream_chat(&model, &msgs, max_tokens, stop_after, timeout)
                    .await;
                let ok = t.error.is_none();
                let tpot_s = match (t.ttft, t.e2e) {
                    (Some(f), Some(e)) if t.output_tokens >= 2 && ok => {
                        Some((e - f).as_secs_f64() / (t.output_tokens - 1) as f64)
                    }
                    _ => None,
                };
                let mut r = record(sent_s, sent_unix_s, t.error.clone());
                r.scheduled_s = if j == 0 { conv.at_s } else { sent_s };
                planned += turn.user_tokens;
                r.prompt_tokens = t.prompt_tokens.unwrap_or(planned);
                planned += turn.output_len;
                r.cached_tokens = t.cached_tokens;
                r.output_tokens = t.output_tokens;
                r.ttft_s = t.ttft.filter(|_| ok).map(|d| d.as_secs_f64());
                r.tpot_s = tpot_s;
                r.e2e_s = t.e2e.filter(|_| ok).map(|d| d.as_secs_f64());
                records.push(r);
                bar.inc(1);
                match t.error {
                    Some(e) => failed = Some(format!("turn {} failed ({e})", j + 1)),
                    None => answers.push(t.text),
                }
            }
            records
        }));
    }
    let mut records = Vec::with_capacity(total);
    for (task, conv) in tasks.into_iter().zip(convs) {
        match task.await {
            Ok(r) => records.extend(r),
            // Every planned turn keeps a record: the conversation's turns count as failed.
            Err(e) => records.extend(conv.turns.iter().map(|t| RequestRecord {
                id: t.id,
                instance: 0,
                model: String::new(),
                rank: None,
                scheduled_s: conv.at_s,
                sent_s: conv.at_s,
                sent_unix_s: 0.0,
                prompt_tokens: t.user_tokens,
                cached_tokens: None,
                max_tokens: t.output_len,
                output_tokens: 0,
                ttft_s: None,
                tpot_s: None,
                e2e_s: None,
                error: Some(format!("client task failed: {e}")),
            })),
        }
    }
    records.sort_by_key(|r| r.id);
    bar.finish_and_clear();
    (records, t0.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::workload::{AdapterInfo, LengthKind, PopularityKind};

    fn server(n: usize, ctx: usize) -> ServerInfo {
        ServerInfo {
            base_model: "base".into(),
            base_root: None,
            max_model_len: Some(ctx),
            adapters: (0..n)
                .map(|i| AdapterInfo {
                    name: format!("a{i}"),
                    rank: Some(8),
                })
                .collect(),
        }
    }

    fn multi() -> ChatArgs {
        ChatArgs {
            multi_turn: true,
            turns: 4,
            system_prompt_len: 50,
            think_time: 0.5,
            no_max_tokens: false,
        }
    }

    fn w(n: usize) -> WorkloadArgs {
        WorkloadArgs {
            requests: n,
            rate: Some(4.0),
            popularity: PopularityKind::Zipf,
            lengths: LengthKind::Fixed,
            prompt_len: 10,
            output_len: 5,
            ..Default::default()
        }
    }

    #[test]
    fn conversations_share_their_adapters_system_prompt_and_grow_turn_by_turn() {
        let s = server(5, 2048);
        let src = PromptSource::random();
        let convs = plan(&multi(), &w(30), &s, &src, 1).unwrap();
        // 30 turns: seven conversations of 4 and one of 2.
        assert_eq!(convs.len(), 8);
        assert_eq!(convs.iter().map(|c| c.turns.len()).sum::<usize>(), 30);
        assert_eq!(convs[7].turns.len(), 2);
        let ids: Vec<usize> = convs
            .iter()
            .flat_map(|c| c.turns.iter().map(|t| t.id))
            .collect();
        assert_eq!(ids, (0..30).collect::<Vec<_>>());
        assert!(convs.windows(2).all(|c| c[0].at_s <= c[1].at_s));
        // One system prompt per adapter: equal under one adapter, different across two.
        for a in &convs {
            for b in &convs {
                assert_eq!(a.adapter == b.adapter, a.system == b.system);
            }
            assert!(a.turns[0].think_s == 0.0 && a.turns[1].think_s > 0.0);
        }
        let sys = convs[0].system.as_ref().unwrap();
        // "You are assistant N." + 50 words.
        assert_eq!(sys.split_whitespace().count(), 54, "{sys}");
        // Turn j carries the system prompt, j earlier exchanges and the new message, and
        // every earlier turn's messages are a prefix of the next turn's.
        let answers = vec!["one".to_string(), "two".to_string(), "three".to_string()];
        let mut prev: Vec<Value> = Vec::new();
        for j in 0..4 {
            let m = messages(&convs[0], &answers, j);
            assert_eq!(m.len(), 2 + 2 * j);
            assert_eq!(m[0]["role"], "system");
            assert_eq!(m.last().unwrap()["content"], convs[0].turns[j].user);
            if j > 0 {
                assert_eq!(m[..prev.len()], prev[..]);
                assert_eq!(m[prev.len()]["content"], answers[j - 1]);
            }
            prev = m;
        }
        assert_eq!(plan(&multi(), &w(30), &s, &src, 1).unwrap(), convs);
        // Another workload seed: other conversations, the same system prompt per adapter.
        let other = plan(&multi(), &WorkloadArgs { seed: 99, ..w(30) }, &s, &src, 1).unwrap();
        assert_ne!(other[0].turns[0].user, convs[0].turns[0].user);
        for a in &convs {
            for b in other.iter().filter(|b| b.adapter == a.adapter) {
                assert_eq!(a.system, b.system);
            }
        }
    }

    #[test]
    fn a_conversation_longer_than_the_context_is_refused_and_single_requests_have_no_system() {
        let e = plan(&multi(), &w(8), &server(2, 100), &PromptSource::random(), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--system-prompt-len"), "{e}");
        let one = ChatArgs {
            multi_turn: false,
            no_max_tokens: true,
            ..multi()
        };
        let convs = plan(&one, &w(6), &server(2, 100), &PromptSource::random(), 1).unwrap();
        assert_eq!(convs.len(), 6);
        assert!(convs
            .iter()
            .all(|c| c.system.is_none() && c.turns.len() == 1));
        assert_eq!(messages(&convs[0], &[], 0).len(), 1);
    }

    #[test]
    fn a_message_is_clipped_to_the_context_with_the_templates_room() {
        for ctx in [16usize, 64, 512, 2048, 4096] {
            for prompt in [1usize, 2, 15, 100, 511, 1000, 2025, 2047, 2048, 5000] {
                for output in [1usize, 7, 300] {
                    let (p, o) = fit_message(prompt, output, ctx);
                    assert!(p >= 1 && o >= 1 && p <= prompt.max(1) && o <= output);
                    assert!(
                        p + slack(p) + o <= ctx,
                        "{prompt}+{output} in {ctx}: {p}+{o}"
                    );
                    if prompt + slack(prompt) + output <= ctx {
                        assert_eq!((p, o), (prompt, output), "what fits is left alone");
                    }
                    // Not clipped further than needed: one more prompt token would not fit
                    // beside one output token.
                    if p < prompt {
                        assert!(p + 1 + slack(p + 1) + 1 > ctx, "{prompt} in {ctx}: {p}");
                    }
                }
            }
        }
        // The plan of a one-message workload marks what it clipped.
        let one = ChatArgs {
            multi_turn: false,
            no_max_tokens: true,
            ..multi()
        };
        let long = WorkloadArgs {
            prompt_len: 2040,
            output_len: 100,
            ..w(3)
        };
        let convs = plan(&one, &long, &server(2, 2048), &PromptSource::random(), 1).unwrap();
        for c in &convs {
            let t = &c.turns[0];
            assert!(t.clipped);
            assert!(t.user_tokens + slack(t.user_tokens) + t.output_len <= 2048);
        }
        let short = plan(&one, &w(3), &server(2, 2048), &PromptSource::random(), 1).unwrap();
        assert!(short.iter().all(|c| !c.turns[0].clipped));
    }
}
