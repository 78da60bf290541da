//! `/v1/completions` with `echo` and `logprobs` over a real socket: the echoed prompt tokens
//! carry the engine's prompt logprobs (`null` for the first token only), streamed and not,
//! through a server whose small token budget chunks every prefill.

use serde_json::{json, Value};
use thaw_runtime::engine::{HostModel, SequenceParams};
use thaw_runtime::ids::SeqId;
use thaw_runtime::model::Tokenizer;
use thaw_tests::http::{post, ServeFixture, SocketServer};
use thaw_tests::step_all_pending;

/// Absolute error allowed between the server's logprobs and the engine's own (whole prefill,
/// no CPU assist) or between two runs of the server: the same logits up to summation order,
/// see `tests/prompt_logprobs.rs`.
const TOL: f64 = 1e-4;

const N: usize = 3;
const MAX_TOKENS: usize = 4;

/// The engine's prompt logprobs for `prompt`, unchunked.
fn engine_prompt_logprobs(fx: &ServeFixture, prompt: &[u32], adapter: Option<usize>) -> Vec<f32> {
    let params = SequenceParams {
        prompt: prompt.to_vec(),
        prompt_logprobs: Some(N),
        ..Default::default()
    };
    let mut e = fx.engine(adapter, params);
    let o = step_all_pending(&mut e, SeqId(0), false).remove(0);
    o.prompt_logprobs.iter().map(|t| t.logprob).collect()
}

/// The `text` and the four logprobs arrays of choice `index` over every chunk of a stream.
fn streamed(body: &str, index: u64) -> (String, Value) {
    let mut text = String::new();
    let mut lp = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for d in thaw_tests::http::sse_data(body) {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        for c in v["choices"].as_array().unwrap() {
            if c["index"] != index {
                continue;
            }
            text.push_str(c["text"].as_str().unwrap());
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let more = c["logprobs"][key].as_array().unwrap().clone();
                lp[key].as_array_mut().unwrap().extend(more);
            }
        }
    }
    (text, lp)
}

fn assert_close(a: &Value, b: &Value, what: &str) {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => assert!((x - y).abs() <= TOL, "{what}: {x} vs {y}"),
        _ => assert_eq!(a, b, "{what}"),
    }
}

#[test]
fn echo_with_logprobs_scores_the_prompt() {
    let fx = ServeFixture::new(&[8]);
    let server = SocketServer::start(thaw_server::serve::ServeConfig {
        // Every prompt below is longer than one step: prefill is chunked.
        max_num_batched_tokens: 5,
        ..fx.config()
    });
    let model = HostModel::load(&fx.model_dir()).unwrap();
    let tok = Tokenizer::from_dir(&fx.model_dir(), &model.config).unwrap();
    let text = "the quick brown fox jumps over the lazy dog";
    let prompt = tok.encode(text, true).unwrap();
    let plen = prompt.len();
    assert!(plen > 5, "the prompt must span several chunks");
    for (adapter, name) in [(None, "base"), (Some(0), fx.adapters[0].0.as_str())] {
        let want = engine_prompt_logprobs(&fx, &prompt, adapter);
        let req = json!({"model": name, "prompt": text, "max_tokens": MAX_TOKENS, "echo": true,
                         "logprobs": N, "temperature": 0, "ignore_eos": true});
        let r = post(server.addr, "/v1/completions", &req);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["usage"]["prompt_tokens"], plen);
        let c = &v["choices"][0];
        assert!(c["text"].as_str().unwrap().starts_with(text));
        let lp = &c["logprobs"];
        let arr = |k: &str| lp[k].as_array().unwrap().clone();
        let (toks, lps, tops, offs) = (
            arr("tokens"),
            arr("token_logprobs"),
            arr("top_logprobs"),
            arr("text_offset"),
        );
        for a in [&toks, &lps, &tops, &offs] {
            assert_eq!(a.len(), plen + MAX_TOKENS, "{name}: one entry per token");
        }
        assert!(
            lps[0].is_null() && tops[0].is_null(),
            "nothing scores the first token"
        );
        for i in 1..plen + MAX_TOKENS {
            let x = lps[i]
                .as_f64()
                .unwrap_or_else(|| panic!("{name}: token {i} unscored"));
            assert!(x <= 0.0, "{name}: logprob {x} > 0");
            let top = tops[i].as_object().unwrap();
            // N alternatives, keyed by text: byte tokens that decode alike (`�`) share a key.
            assert!(
                (1..=N).contains(&top.len()),
                "{name}: token {i} alternatives {top:?}"
            );
            assert!(top.values().all(|v| v.as_f64().unwrap() <= 0.0));
        }
        assert!(
            tops.iter()
                .any(|t| t.as_object().is_some_and(|o| o.len() == N)),
            "{name}: no token has {N} alternatives"
        );
        for (i, w) in want.iter().enumerate() {
            let got = lps[i + 1].as_f64().unwrap();
            assert!(
                (got - *w as f64).abs() <= TOL,
                "{name}: prompt token {}: served {got}, engine {w}",
                i + 1
            );
        }
        for i in 0..plen {
            // Special tokens (BOS) included, as OpenAI's logprobs show them.
            assert_eq!(toks[i], json!(tok.decode(&[prompt[i]], false).unwrap()));
        }
        assert_eq!(offs[0], 0);
        for i in 1..plen {
            let step = toks[i - 1].as_str().unwrap().len() as u64;
            assert_eq!(
                offs[i].as_u64().unwrap(),
                offs[i - 1].as_u64().unwrap() + step
            );
        }
        assert_eq!(
            offs[plen],
            text.len(),
            "generated offsets follow the echoed text"
        );

        // Streaming (two choices) carries the same tokens, text and values.
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        sreq["n"] = json!(2);
        let r = post(server.addr, "/v1/completions", &sreq);
        assert_eq!(r.status, 200, "{}", r.text());
        for index in 0..2 {
            let (stext, slp) = streamed(&r.text(), index);
            assert_eq!(stext, c["text"].as_str().unwrap(), "{name}: streamed text");
            for key in ["tokens", "text_offset"] {
                assert_eq!(slp[key], lp[key], "{name}: streamed {key}");
            }
            for i in 0..plen + MAX_TOKENS {
                assert_close(&slp["token_logprobs"][i], &lps[i], "streamed logprob");
                let (a, b) = (&slp["top_logprobs"][i], &tops[i]);
                assert_eq!(a.is_null(), b.is_null());
                if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
                    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
                    for (k, x) in a {
                        assert_close(x, &b[k], "streamed alternative");
                    }
                }
            }
        }
    }

    // Without echo nothing of the prompt shows; echo without logprobs is text only.
    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"model": "base", "prompt": text, "max_tokens": 2, "logprobs": 1,
                "ignore_eos": true}),
    );
    assert_eq!(
        r.json()["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"model": "base", "prompt": text, "max_tokens": 2, "echo": true,
                "ignore_eos": true, "stream": true}),
    );
    let (stext, _) = streamed_text_only(&r.text());
    assert!(stext.starts_with(text));
}

/// The text of choice 0 over a stream without logprobs.
fn streamed_text_only(body: &str) -> (String, usize) {
    let mut text = String::new();
    let mut chunks = 0;
    for d in thaw_tests::http::sse_data(body) {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        for c in v["choices"].as_array().unwrap() {
            assert!(c["logprobs"].is_null());
            text.push_str(c["text"].as_str().unwrap());
            chunks += 1;
        }
    }
    (text, chunks)
}
