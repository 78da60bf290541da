//! Reading the Azure LLM inference traces (`../shared/traces/*.csv`, schema
//! `TIMESTAMP,ContextTokens,GeneratedTokens`): request lengths, and arrival times relative to
//! the first request for replay.
use std::path::Path;

use anyhow::Context;

/// One trace row: seconds since the trace's first request, prompt and output tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceRow {
    pub at_s: f64,
    pub prompt: usize,
    pub output: usize,
}

/// Reads (prompt, output) lengths from an Azure trace CSV.
pub fn trace_lengths(path: &Path) -> anyhow::Result<Vec<(usize, usize)>> {
    Ok(read_trace(path)?
        .into_iter()
        .map(|r| (r.prompt, r.output))
        .collect())
}

/// Reads every row of an Azure trace CSV, in file order, with arrival times in seconds since
/// the earliest timestamp.
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<TraceRow>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading trace {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        anyhow::ensure!(
            f.len() == 3,
            "{}:{}: expected 3 fields (TIMESTAMP,ContextTokens,GeneratedTokens)",
            path.display(),
            i + 1
        );
        let at_s = parse_timestamp(f[0].trim())
            .with_context(|| format!("{}:{}: bad timestamp `{}`", path.display(), i + 1, f[0]))?;
        let num = |s: &str| -> anyhow::Result<usize> {
            s.trim()
                .parse()
                .with_context(|| format!("{}:{}: bad token count `{s}`", path.display(), i + 1))
        };
        rows.push(TraceRow {
            at_s,
            prompt: num(f[1])?,
            output: num(f[2])?,
        });
    }
    anyhow::ensure!(!rows.is_empty(), "{} has no requests", path.display());
    let t0 = rows.iter().map(|r| r.at_s).fold(f64::INFINITY, f64::min);
    for r in &mut rows {
        r.at_s -= t0;
    }
    Ok(rows)
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` as seconds since 1970-01-01 (the trace is UTC; only
/// differences matter).
pub fn parse_timestamp(s: &str) -> anyhow::Result<f64> {
    let (date, time) = s
        .split_once([' ', 'T'])
        .context("expected `YYYY-MM-DD HH:MM:SS`")?;
    let d: Vec<i64> = date
        .split('-')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("bad date")?;
    anyhow::ensure!(d.len() == 3, "bad date");
    let t: Vec<&str> = time.split(':').collect();
    anyhow::ensure!(t.len() == 3, "bad time");
    let (h, m): (i64, i64) = (t[0].parse()?, t[1].parse()?);
    let sec: f64 = t[2].parse()?;
    Ok(days_from_civil(d[0], d[1], d[2]) as f64 * 86_400.0 + (h * 3600 + m * 60) as f64 + sec)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_cross_midnight_and_months() {
        let a = parse_timestamp("2023-11-16 23:59:59.5").unwrap();
        let b = parse_timestamp("2023-11-17 00:00:00.5").unwrap();
        assert!((b - a - 1.0).abs() < 1e-9);
        let c = parse_timestamp("2023-12-01 00:00:00").unwrap();
        let d = parse_timestamp("2023-11-30 00:00:00").unwrap();
        assert!((c - d - 86_400.0).abs() < 1e-9);
        assert_eq!(parse_timestamp("1970-01-01 00:00:00").unwrap(), 0.0);
    }

    #[test]
    fn reads_the_shared_code_trace_in_order() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/traces/AzureLLMInferenceTrace_code.csv");
        if !p.exists() {
            eprintln!("skipped: {} not found", p.display());
            return;
        }
        let rows = read_trace(&p).unwrap();
        assert_eq!(rows.len(), 8_819);
        assert_eq!(rows[0].at_s, 0.0);
        assert_eq!((rows[0].prompt, rows[0].output), (4808, 10));
        assert!((rows[1].at_s - 0.052).abs() < 1e-6);
        assert!(rows.windows(2).all(|w| w[1].at_s >= w[0].at_s));
    }

    #[test]
    fn bad_rows_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        std::fs::write(
            &p,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1\n",
        )
        .unwrap();
        let e = format!("{:#}", read_trace(&p).unwrap_err());
        assert!(e.contains(":2:"), "{e}");
    }
}
