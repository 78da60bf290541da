//! The server's error type: every way a request can fail, each with the HTTP status and
//! OpenAI error fields it maps to. Messages are written for the client; internal details
//! (engine failures, panics) only reach the log.
use thaw_runtime::adapter::AdapterError;

/// Errors a request or an admin call can end with.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "This model's maximum context length is {max} tokens. However, you requested {total} \
         tokens ({prompt} in the prompt, {completion} for the completion). Please reduce the \
         length of the prompt or max_tokens."
    )]
    ContextTooLong {
        max: usize,
        total: usize,
        prompt: usize,
        completion: usize,
        param: &'static str,
    },
    #[error("the request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error(
        "the server's queue is full ({max} waiting requests, --max-queued-requests); retry later"
    )]
    QueueFull { max: usize },
    #[error("the server is shutting down and accepts no new requests")]
    ShuttingDown,
    #[error("adapter `{name}`: {source}")]
    Adapter {
        name: String,
        #[source]
        source: AdapterError,
    },
    #[error(
        "adapter `{name}` has rank {rank}, above --max-lora-rank {max}; restart with a larger limit"
    )]
    RankTooLarge {
        name: String,
        rank: usize,
        max: usize,
    },
    #[error("no adapter named `{0}` is loaded")]
    AdapterNotLoaded(String),
    #[error(
        "adapter `{name}` is still used by {requests} request(s) after waiting {waited_secs:.0} s; \
         it takes no new requests and is unloaded when they finish"
    )]
    AdapterBusy {
        name: String,
        requests: usize,
        waited_secs: f64,
    },
    #[error(
        "all {max} device adapter slots (--max-loras) are in use by running requests; retry \
         shortly, or drop --adapter-eviction fixed-slots so such requests wait in the queue"
    )]
    NoAdapterSlot { max: usize },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Aborted(String),
    #[error(
        "missing or invalid API key; send `Authorization: Bearer KEY` with a key the server \
         was started with (--api-key / THAW_API_KEY)"
    )]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("the scheduler thread has stopped")]
    SchedulerGone,
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServerError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::InvalidParam {
            param: param.to_string(),
            message: message.into(),
        }
    }

    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        use ServerError::*;
        match self {
            ModelNotFound(_) | AdapterNotLoaded(_) | NotFound(_) => 404,
            InvalidParam { .. } | BadRequest(_) | ContextTooLong { .. } | RankTooLarge { .. } => {
                400
            }
            BodyTooLarge { .. } => 413,
            Unauthorized => 401,
            Forbidden(_) => 403,
            QueueFull { .. } | NoAdapterSlot { .. } => 429,
            ShuttingDown | Aborted(_) => 503,
            AdapterBusy { .. } => 409,
            Adapter { source, .. } => match source {
                AdapterError::NotFound { .. } => 404,
                AdapterError::ConfigNotJson { .. } => 400,
                _ => 422,
            },
            SchedulerGone | Internal(_) => 500,
        }
    }

    /// OpenAI's `error.type`.
    pub fn error_type(&self) -> &'static str {
        match self.status() {
            429 => "rate_limit_error",
            503 => "service_unavailable_error",
            500 => "internal_server_error",
            404 => "NotFoundError",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's `error.param`.
    pub fn param(&self) -> Option<&str> {
        use ServerError::*;
        match self {
            ModelNotFound(_) => Some("model"),
            InvalidParam { param, .. } => Some(param),
            ContextTooLong { param, .. } => Some(param),
            Adapter { .. } | RankTooLarge { .. } => Some("lora_path"),
            AdapterNotLoaded(_) => Some("lora_name"),
            _ => None,
        }
    }

    /// OpenAI's `error.code`.
    pub fn code(&self) -> Option<&'static str> {
        use ServerError::*;
        Some(match self {
            ModelNotFound(_) => "model_not_found",
            InvalidParam { .. } => "invalid_value",
            ContextTooLong { .. } => "context_length_exceeded",
            BodyTooLarge { .. } => "request_too_large",
            QueueFull { .. } => "queue_full",
            Unauthorized => "invalid_api_key",
            Forbidden(_) => "forbidden",
            ShuttingDown => "shutting_down",
            Aborted(_) => "aborted",
            Adapter { source, .. } => match source {
                AdapterError::NotFound { .. } => "adapter_not_found",
                _ => "unsupported_adapter",
            },
            RankTooLarge { .. } => "rank_too_large",
            AdapterNotLoaded(_) => "adapter_not_found",
            AdapterBusy { .. } => "adapter_in_use",
            NoAdapterSlot { .. } => "no_adapter_slot",
            _ => return None,
        })
    }

    /// What the client sees: internal errors are reduced to a generic sentence.
    pub fn client_message(&self) -> String {
        match self {
            ServerError::SchedulerGone | ServerError::Internal(_) => {
                "internal server error; see the server log".to_string()
            }
            e => e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_issue() {
        assert_eq!(ServerError::ModelNotFound("x".into()).status(), 404);
        assert_eq!(
            ServerError::ModelNotFound("x".into()).to_string(),
            "The model `x` does not exist."
        );
        let a = |source| ServerError::Adapter {
            name: "a".into(),
            source,
        };
        assert_eq!(a(AdapterError::Dora).status(), 422);
        assert_eq!(a(AdapterError::Bias("all".into())).status(), 422);
        assert_eq!(
            a(AdapterError::NotFound { path: "/x".into() }).status(),
            404
        );
        let nj = AdapterError::ConfigNotJson {
            path: "/x".into(),
            reason: "eof".into(),
        };
        assert_eq!(a(nj).status(), 400);
        assert_eq!(ServerError::QueueFull { max: 1 }.status(), 429);
        assert_eq!(ServerError::ShuttingDown.status(), 503);
        assert_eq!(ServerError::BodyTooLarge { limit: 1 }.status(), 413);
        let internal = ServerError::Internal("secret path /etc".into());
        assert!(!internal.client_message().contains("secret"));
    }
}
