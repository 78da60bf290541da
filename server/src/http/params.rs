//! Validating OpenAI sampling fields into engine parameters, naming the bad field on error.
use thaw_runtime::sampling::SamplingParams;

use super::openai_types::{SamplingFields, Stop};
use crate::error::ServerError;

/// Most choices per prompt (`n`).
pub const MAX_N: usize = 16;
/// Most top alternatives per token (`logprobs` / `top_logprobs`), as OpenAI allows.
pub const MAX_LOGPROBS: usize = 20;

/// A request's validated generation settings.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    /// None: the endpoint's default (16 for completions, the rest of the context for chat).
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Admission order under `--scheduling-policy priority`, lower first (vLLM); default 0.
    pub priority: i64,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Return per-token logprobs (with `sampling.top_logprobs` alternatives).
    pub logprobs: bool,
    /// Score the prompt too, with this many alternatives per token (completions with `echo`
    /// and `logprobs`); None costs the engine nothing.
    pub prompt_logprobs: Option<usize>,
}

fn positive(param: &str, v: Option<i64>, max: usize) -> Result<Option<usize>, ServerError> {
    match v {
        None => Ok(None),
        Some(x) if x >= 1 && (x as u64) <= max as u64 => Ok(Some(x as usize)),
        Some(x) => Err(ServerError::invalid(
            param,
            format!("`{param}` must be between 1 and {max}, got {x}"),
        )),
    }
}

fn unsupported_nonzero(param: &str, v: Option<f64>, neutral: f64) -> Result<(), ServerError> {
    match v {
        Some(x) if x != neutral => Err(ServerError::invalid(
            param,
            format!("`{param}` is not supported by this server; omit it or send {neutral}"),
        )),
        _ => Ok(()),
    }
}

/// Checks the shared fields. `logprobs`: the number of alternatives wanted, if any.
pub fn validate(f: &SamplingFields, logprobs: Option<usize>) -> Result<GenParams, ServerError> {
    let max_tokens = positive("max_tokens", f.max_tokens, u32::MAX as usize)?;
    let temperature = f.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=100.0).contains(&temperature)) {
        return Err(ServerError::invalid(
            "temperature",
            format!("`temperature` must be between 0 and 100, got {temperature}"),
        ));
    }
    let top_p = f.top_p.unwrap_or(1.0);
    // Judged as the engine gets it too (f32): 1e-320 is > 0 as f64 but 0 as f32.
    if !(top_p > 0.0 && top_p <= 1.0 && top_p as f32 > 0.0) {
        return Err(ServerError::invalid(
            "top_p",
            format!("`top_p` must be in (0, 1] and at least 1e-38, got {top_p}"),
        ));
    }
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ServerError::invalid(
                "top_k",
                format!("`top_k` must be -1 (off) or a positive number, got {k}"),
            ))
        }
    };
    let n = positive("n", f.n, MAX_N)?.unwrap_or(1);
    unsupported_nonzero("presence_penalty", f.presence_penalty, 0.0)?;
    unsupported_nonzero("frequency_penalty", f.frequency_penalty, 0.0)?;
    unsupported_nonzero("repetition_penalty", f.repetition_penalty, 1.0)?;
    if let Some(b) = &f.logit_bias {
        if !(b.is_null() || b.as_object().is_some_and(|o| o.is_empty())) {
            return Err(ServerError::invalid(
                "logit_bias",
                "`logit_bias` is not supported by this server; omit it",
            ));
        }
    }
    let stop: Vec<String> = match &f.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    }
    .into_iter()
    .filter(|s| !s.is_empty())
    .collect();
    let stream = f.stream.unwrap_or(false);
    let include_usage = f
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    if f.stream_options.is_some() && !stream {
        return Err(ServerError::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    Ok(GenParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            seed: f.seed.map(|s| s as u64),
            top_logprobs: logprobs.unwrap_or(0),
            logprobs: logprobs.is_some(),
        },
        stop,
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        priority: f.priority.unwrap_or(0),
        n,
        stream,
        include_usage,
        logprobs: logprobs.is_some(),
        prompt_logprobs: None,
    })
}

/// `logprobs` / `top_logprobs` range check.
pub fn logprobs_count(param: &str, v: Option<i64>) -> Result<Option<usize>, ServerError> {
    match v {
        None => Ok(None),
        Some(x) if (0..=MAX_LOGPROBS as i64).contains(&x) => Ok(Some(x as usize)),
        Some(x) => Err(ServerError::invalid(
            param,
            format!("`{param}` must be between 0 and {MAX_LOGPROBS}, got {x}"),
        )),
    }
}

/// The seed of choice `i` of a request: distinct per choice, reproducible from `seed`.
pub fn choice_seed(seed: Option<u64>, i: usize) -> Option<u64> {
    seed.map(|s| {
        if i == 0 {
            s
        } else {
            s.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `request_json_structured` fuzz target: a subnormal `top_p` passed the f64
    /// check, became 0 as f32 and was refused by the engine with a 503.
    #[test]
    fn top_p_that_rounds_to_zero_is_a_400() {
        let f = SamplingFields {
            top_p: Some(1e-320),
            ..SamplingFields::default()
        };
        let e = validate(&f, None).unwrap_err();
        assert_eq!(e.param(), Some("top_p"));
    }

    proptest::proptest! {
        /// What the HTTP layer accepts, the engine accepts: its own check never turns a
        /// validated request into a 5xx.
        #[test]
        fn accepted_sampling_passes_the_engine_check(
            temperature in proptest::num::f64::ANY,
            top_p in proptest::num::f64::ANY,
        ) {
            let f = SamplingFields {
                temperature: Some(temperature),
                top_p: Some(top_p),
                ..SamplingFields::default()
            };
            if let Ok(p) = validate(&f, None) {
                proptest::prop_assert!(p.sampling.validate().is_ok(), "{temperature} {top_p}");
            }
        }
    }

    #[test]
    fn names_the_bad_field() {
        let bad = |f: SamplingFields| validate(&f, None).unwrap_err().param().map(String::from);
        let d = SamplingFields::default();
        assert_eq!(
            bad(SamplingFields {
                temperature: Some(-1.0),
                ..d.clone()
            }),
            Some("temperature".into())
        );
        assert_eq!(
            bad(SamplingFields {
                max_tokens: Some(0),
                ..d.clone()
            }),
            Some("max_tokens".into())
        );
        assert_eq!(
            bad(SamplingFields {
                n: Some(100),
                ..d.clone()
            }),
            Some("n".into())
        );
        assert_eq!(
            bad(SamplingFields {
                top_k: Some(-5),
                ..d.clone()
            }),
            Some("top_k".into())
        );
        assert_eq!(
            bad(SamplingFields {
                presence_penalty: Some(0.5),
                ..d.clone()
            }),
            Some("presence_penalty".into())
        );
        let ok = validate(
            &SamplingFields {
                stop: Some(Stop::One("\n".into())),
                seed: Some(-1),
                ..d
            },
            Some(3),
        )
        .unwrap();
        assert_eq!(ok.stop, vec!["\n".to_string()]);
        assert_eq!(ok.sampling.top_logprobs, 3);
        assert_eq!(choice_seed(Some(5), 0), Some(5));
        assert_ne!(choice_seed(Some(5), 1), Some(5));
    }
}
