//! Server-sent events the way OpenAI streams: `data: {json}` chunks, an optional usage chunk,
//! then `data: [DONE]`. Choices of one request are merged as they produce tokens. Dropping
//! the stream (client gone) drops every choice, which cancels their engine sequences.
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;

use super::error::error_body;
use super::generation::{ChoiceStream, Delta, Finish};
use crate::error::ServerError;

/// Builds the event stream. `first`: chunks sent before any token (e.g. the chat role);
/// `chunk`: the JSON of one choice's delta; `usage`: the final usage chunk from the total of
/// completion tokens and of prompt tokens found in the prefix cache, when the client asked
/// for it.
pub fn stream_choices<C, U>(
    choices: Vec<ChoiceStream>,
    first: Vec<Value>,
    mut chunk: C,
    usage: Option<U>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    C: FnMut(usize, &Delta) -> Value + Send + 'static,
    U: FnOnce(usize, usize) -> Value + Send + 'static,
{
    let total = Arc::new(AtomicUsize::new(0));
    let counted = total.clone();
    let cached = Arc::new(AtomicUsize::new(0));
    let cached_in = cached.clone();
    let merged = stream::select_all(choices.into_iter().map(|c| {
        Box::pin(stream::unfold(c, |mut c| async move {
            let d = c.next().await?;
            Some(((c.index, d), c))
        }))
    }));
    let head = stream::iter(first).map(|v| Event::default().data(v.to_string()));
    let body = merged.map(move |(index, d)| {
        counted.fetch_add(d.num_tokens, Ordering::Relaxed);
        cached_in.fetch_add(d.cached_tokens, Ordering::Relaxed);
        if let Some(Finish::Abort(msg)) = &d.finish {
            return Event::default()
                .data(error_body(&ServerError::Aborted(msg.clone())).to_string());
        }
        Event::default().data(chunk(index, &d).to_string())
    });
    let tail = stream::once(async move {
        usage.map(|u| {
            Event::default().data(
                u(
                    total.load(Ordering::Relaxed),
                    cached.load(Ordering::Relaxed),
                )
                .to_string(),
            )
        })
    })
    .filter_map(|e| async move { e });
    let done = stream::once(async { Event::default().data("[DONE]") });
    Sse::new(head.chain(body).chain(tail).chain(done).map(Ok))
}
