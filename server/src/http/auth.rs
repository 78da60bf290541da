//! API keys (`--api-key`, `THAW_API_KEY`): every `/v1/*` request must carry
//! `Authorization: Bearer KEY` with one of the configured keys, as in vLLM. `/health` and
//! `/metrics` stay open so probes and Prometheus need no secret.
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::app::AppState;
use crate::error::ServerError;

/// The keys a client may present; empty means no authentication.
#[derive(Clone, Default)]
pub struct ApiKeys(Vec<Vec<u8>>);

impl std::fmt::Debug for ApiKeys {
    /// Never prints the keys themselves.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} key(s))", self.0.len())
    }
}

impl ApiKeys {
    pub fn new<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Self {
        Self(
            keys.into_iter()
                .map(|k| k.as_ref().as_bytes().to_vec())
                .collect(),
        )
    }

    pub fn is_enabled(&self) -> bool {
        !self.0.is_empty()
    }

    /// Whether `presented` is one of the keys. Every key is compared, each in time that
    /// depends only on the key's length, so the answer's timing does not tell an attacker
    /// how many leading bytes of a guess were right, nor which key matched.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut any = 0u8;
        for key in &self.0 {
            any |= ct_eq(key, presented) as u8;
        }
        any == 1
    }

    /// Whether an `Authorization` header value carries an accepted bearer token.
    pub fn authorizes(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(v) = authorization else {
            return false;
        };
        let v = v.as_bytes();
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let token = match v.split_at_checked(7) {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case(b"bearer ") => token,
            _ => return false,
        };
        self.accepts(token)
    }
}

/// Constant-time equality: the loop runs over `key` (a server secret whose length is fixed)
/// whatever `guess` is, and folds every byte difference and the length difference into one
/// accumulator, with no early exit.
fn ct_eq(key: &[u8], guess: &[u8]) -> bool {
    let mut diff = (key.len() ^ guess.len()) as u64;
    for (i, k) in key.iter().enumerate() {
        let g = guess.get(i).copied().unwrap_or(!k);
        diff |= u64::from(k ^ g);
    }
    std::hint::black_box(diff) == 0
}

/// Whether `path` needs a key: the OpenAI API under `/v1`, as in vLLM.
fn guarded(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/")
}

/// Middleware: 401 with an OpenAI error body for a `/v1/*` request without an accepted key.
pub async fn require_api_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    if !state.api_keys.is_enabled()
        || !guarded(req.uri().path())
        || state
            .api_keys
            .authorizes(req.headers().get(header::AUTHORIZATION))
    {
        return next.run(req).await;
    }
    let mut resp = ServerError::Unauthorized.into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bearer_tokens() {
        let keys = ApiKeys::new(["sk-one", "sk-two"]);
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(keys.authorizes(Some(&h("Bearer sk-one"))));
        assert!(keys.authorizes(Some(&h("bearer sk-two"))));
        for bad in [
            "Bearer sk-on",
            "Bearer sk-one ",
            "Bearer sk-onee",
            "Basic sk-one",
            "sk-one",
            "Bearer",
            "Bearer ",
            "",
        ] {
            assert!(!keys.authorizes(Some(&h(bad))), "{bad:?}");
        }
        assert!(!keys.authorizes(None));
        assert!(!ApiKeys::default().accepts(b""));
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 key(s))");
        assert!(guarded("/v1/models") && guarded("/v1") && !guarded("/v10") && !guarded("/health"));
    }

    proptest! {
        /// ct_eq is plain equality, whatever the lengths and bytes.
        #[test]
        fn ct_eq_is_equality(a in proptest::collection::vec(any::<u8>(), 0..40),
                             b in proptest::collection::vec(any::<u8>(), 0..40)) {
            prop_assert_eq!(ct_eq(&a, &b), a == b);
            prop_assert!(ct_eq(&a, &a.clone()));
        }
    }
}
