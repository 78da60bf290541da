//! OpenAI error bodies, and a JSON body extractor whose failures are OpenAI errors too
//! (413 for an oversized body, 400 naming the field for a bad one).
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::error::ServerError;

/// `Retry-After` on every 429 (queue full, no adapter slot).
pub const RETRY_AFTER_SECS: &str = "1";

/// The `{"error": {...}}` body of an error.
pub fn error_body(e: &ServerError) -> serde_json::Value {
    json!({
        "error": {
            "message": e.client_message(),
            "type": e.error_type(),
            "param": e.param(),
            "code": e.code(),
        }
    })
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::error!("request failed: {self}");
        } else {
            tracing::debug!("request rejected ({status}): {self}");
        }
        let mut resp = (status, Json(error_body(&self))).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            // The queue drains in about a step's time; a client that honours the header comes
            // back soon without hammering.
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        resp
    }
}

/// A JSON body parsed with the failing field's path reported.
pub struct OpenAiJson<T>(pub T);

/// The field a serde error is about: its path, or the field named by "missing field `x`".
fn error_param(path: &str, msg: &str) -> Option<String> {
    if let Some(rest) = msg.strip_prefix("missing field `") {
        let field = rest.split('`').next().unwrap_or_default();
        return Some(if path == "." || path.is_empty() {
            field.to_string()
        } else {
            format!("{path}.{field}")
        });
    }
    (path != "." && !path.is_empty()).then(|| path.to_string())
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OpenAiJson<T> {
    type Rejection = ServerError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ServerError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map(|l| l.0)
            .unwrap_or(0);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ServerError::BodyTooLarge { limit }
            } else {
                ServerError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?;
        let de = &mut serde_json::Deserializer::from_slice(&bytes);
        match serde_path_to_error::deserialize(de) {
            Ok(v) => Ok(OpenAiJson(v)),
            Err(e) => {
                let path = e.path().to_string();
                let inner = e.into_inner();
                let msg = inner.to_string();
                if inner.is_syntax() || inner.is_eof() {
                    return Err(ServerError::BadRequest(format!(
                        "the request body is not valid JSON: {msg}"
                    )));
                }
                // Flattened fields (the shared sampling fields) lose their path; find it by
                // parsing them alone.
                let param = error_param(&path, &msg).or_else(|| flattened_param(&bytes));
                Err(match param {
                    Some(param) => ServerError::InvalidParam {
                        message: format!("invalid `{param}`: {msg}"),
                        param,
                    },
                    None => ServerError::BadRequest(format!("invalid request body: {msg}")),
                })
            }
        }
    }
}

fn flattened_param(bytes: &[u8]) -> Option<String> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, super::openai_types::SamplingFields>(de) {
        Err(e) => {
            let path = e.path().to_string();
            (path != "." && !path.is_empty()).then_some(path)
        }
        Ok(_) => None,
    }
}

/// The body limit in force, put in request extensions so the 413 message can say it.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);
