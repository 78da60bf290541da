//! `--dump-cost-model PATH` also writes `PATH.steps.jsonl`: one JSON line per engine step
//! (its shape, the context its decode rows attend over, its kernel, whether CPU assist
//! stretched it, its measured time and the loop's gap before it) and one per request's first
//! token (when it reached the engine, when it was first planned, when its first token came).
//! The fitted model is only as good as the steps it saw; this is what it saw, so a fit can be
//! checked or redone offline (`thaw-bench simulate --refit PATH.steps.jsonl`).
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::enginetime::CauseTimes;
use super::model::StepShape;

/// One line of the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LogLine {
    /// One engine step. Times in seconds; `t` is Unix seconds at its start.
    Step {
        t: f64,
        tokens: usize,
        decode: usize,
        lora_rows: usize,
        rank_rows: usize,
        max_rank: usize,
        /// Σ over decode rows of the tokens already in their sequence's KV cache.
        decode_ctx: usize,
        bgmv: bool,
        /// CPU assist ran in the step (the fit sees it without its assist overhead).
        assisted: bool,
        elapsed_s: f64,
        /// Wall time since the previous step ended, while steps ran back to back.
        gap_s: Option<f64>,
        /// Sequences the step prefills. Older logs lack it.
        #[serde(default)]
        prefills: usize,
        /// Wall time since the previous step ended, whatever the loop did meanwhile (None:
        /// the first step). Older logs lack it.
        #[serde(default)]
        idle_s: Option<f64>,
        /// The shape's after-idle flag: `idle_s` ≥ the model's `after_idle_gap_s`, or no
        /// previous step. Older logs lack it (false).
        #[serde(default)]
        after_idle: bool,
        /// The engine thread's time by cause since the previous step line, this step's
        /// forward included: a stall behind adapter work shows here. Older logs lack it.
        #[serde(default)]
        engine_time: Option<CauseTimes>,
    },
    /// A request's first token, Unix seconds.
    First {
        arrived: f64,
        planned: f64,
        first_token: f64,
        prompt: usize,
    },
}

/// Appends [`LogLine`]s to a file, buffered (flushed every few lines and when dropped).
#[derive(Debug)]
pub struct StepLog {
    out: BufWriter<File>,
    /// An instant and the Unix time it was, to put instants on the Unix clock.
    base: (Instant, f64),
    unflushed: usize,
}

/// Where `--dump-cost-model PATH`'s step log goes: `PATH` with the extension `steps.jsonl`.
pub fn steps_path(dump: &Path) -> PathBuf {
    dump.with_extension("steps.jsonl")
}

impl StepLog {
    const FLUSH_EVERY: usize = 64;

    /// Creates (truncates) the log at `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        Ok(Self {
            out: BufWriter::new(File::create(path)?),
            base: (Instant::now(), unix),
            unflushed: 0,
        })
    }

    /// `at` on the Unix clock.
    pub fn unix(&self, at: Instant) -> f64 {
        let (i, u) = self.base;
        if at >= i {
            u + (at - i).as_secs_f64()
        } else {
            u - (i - at).as_secs_f64()
        }
    }

    /// Logs one step of `shape` that started at `started`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        shape: &StepShape,
        decode_ctx: usize,
        bgmv: bool,
        assisted: bool,
        started: Instant,
        elapsed: f64,
        gap: Option<f64>,
        idle: Option<f64>,
        engine_time: CauseTimes,
    ) {
        let line = LogLine::Step {
            t: self.unix(started),
            tokens: shape.tokens,
            decode: shape.decode,
            lora_rows: shape.lora_rows,
            rank_rows: shape.rank_rows,
            max_rank: shape.max_rank,
            prefills: shape.prefills,
            decode_ctx,
            bgmv,
            assisted,
            elapsed_s: elapsed,
            gap_s: gap,
            idle_s: idle,
            after_idle: shape.after_idle,
            engine_time: Some(engine_time),
        };
        self.write(&line);
    }

    /// Logs a request's first token.
    pub fn first(&mut self, arrived: Instant, planned: Instant, first: Instant, prompt: usize) {
        let line = LogLine::First {
            arrived: self.unix(arrived),
            planned: self.unix(planned),
            first_token: self.unix(first),
            prompt,
        };
        self.write(&line);
    }

    fn write(&mut self, line: &LogLine) {
        // A diagnostic file: a full disk must not stop serving, so errors end the logging.
        let ok =
            serde_json::to_writer(&mut self.out, line).is_ok() && self.out.write_all(b"\n").is_ok();
        self.unflushed += 1;
        if !ok || self.unflushed >= Self::FLUSH_EVERY {
            let _ = self.out.flush();
            self.unflushed = 0;
        }
    }
}

impl Drop for StepLog {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// Reads a step log; lines that do not parse are reported with their number.
pub fn read(path: &Path) -> anyhow::Result<Vec<LogLine>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the step log {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| {
                format!(
                    "{} line {} is not a step log line written by `thaw serve --dump-cost-model`",
                    path.display(),
                    i + 1
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lines_round_trip_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = steps_path(&dir.path().join("cost.json"));
        assert!(p.ends_with("cost.steps.jsonl"));
        let t0 = Instant::now();
        {
            let mut log = StepLog::create(&p).unwrap();
            let mut s = StepShape::default();
            s.add(3, true, Some(16));
            s.add(40, false, None);
            for i in 0..100 {
                s.after_idle = i == 0;
                log.step(
                    &s,
                    300 + i,
                    i % 2 == 0,
                    false,
                    t0,
                    0.01,
                    Some(2e-4),
                    Some(0.5),
                    CauseTimes {
                        forward_s: 0.01,
                        adapter_s: i as f64 * 1e-6,
                        ..Default::default()
                    },
                );
            }
            log.first(
                t0,
                t0 + Duration::from_millis(5),
                t0 + Duration::from_millis(50),
                40,
            );
        }
        let lines = read(&p).unwrap();
        assert_eq!(lines.len(), 101);
        match &lines[1] {
            LogLine::Step {
                tokens,
                decode,
                rank_rows,
                decode_ctx,
                bgmv,
                idle_s,
                after_idle,
                engine_time,
                ..
            } => {
                assert_eq!(
                    (
                        *tokens,
                        *decode,
                        *rank_rows,
                        *decode_ctx,
                        *bgmv,
                        *idle_s,
                        *after_idle
                    ),
                    (43, 3, 48, 301, false, Some(0.5), false)
                );
                assert_eq!(engine_time.unwrap().adapter_s, 1e-6);
            }
            l => panic!("{l:?}"),
        }
        match &lines[100] {
            LogLine::First {
                arrived,
                planned,
                first_token,
                ..
            } => {
                assert!((planned - arrived - 0.005).abs() < 1e-6);
                assert!((first_token - arrived - 0.05).abs() < 1e-6);
            }
            l => panic!("{l:?}"),
        }
        assert!(matches!(
            lines[0],
            LogLine::Step {
                after_idle: true,
                ..
            }
        ));
        // A line written before the after-idle flag existed reads as not after idle.
        std::fs::write(
            &p,
            "{\"kind\":\"step\",\"t\":1.0,\"tokens\":4,\"decode\":4,\"lora_rows\":0,\
             \"rank_rows\":0,\"max_rank\":0,\"decode_ctx\":9,\"bgmv\":false,\
             \"assisted\":false,\"elapsed_s\":0.01,\"gap_s\":null}\n",
        )
        .unwrap();
        match &read(&p).unwrap()[0] {
            LogLine::Step {
                idle_s,
                after_idle,
                engine_time,
                ..
            } => assert_eq!((*idle_s, *after_idle, *engine_time), (None, false, None)),
            l => panic!("{l:?}"),
        }
        std::fs::write(&p, "{\"kind\":\"nope\"}\n").unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
    }
}
