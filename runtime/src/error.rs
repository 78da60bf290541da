//! The runtime's error type: every way a load, a registration or a step can fail.
use crate::adapter::AdapterError;
use crate::ids::{AdapterId, SeqId};
use crate::model::ModelError;

/// Errors from the engine and its loaders.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error("sequence {0} is not known to the engine (finished, removed or never added)")]
    UnknownSequence(SeqId),
    #[error("sequence {0} was added twice; sequence ids must be unique")]
    DuplicateSequence(SeqId),
    #[error("adapter {0} is not registered with the engine; register it before adding sequences that use it")]
    UnknownAdapter(AdapterId),
    #[error("adapter {0} still has {1} running sequence(s); remove them before unregistering it")]
    AdapterInUse(AdapterId, usize),
    #[error(
        "KV cache exhausted: step needs {needed} more block(s), {free} free of {total}; \
         schedule fewer tokens or start with more KV blocks"
    )]
    KvExhausted {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error(
        "sequence {seq} would reach {len} tokens, over the model's context of {max}; \
         shorten the prompt or lower max_tokens"
    )]
    ContextOverflow { seq: SeqId, len: usize, max: usize },
    #[error("invalid step plan: {0}")]
    InvalidPlan(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("backend error: {0}")]
    Backend(String),
    /// No run of pages of the one device budget for an adapter's image (KV blocks in use
    /// split the free ones): the caller may evict idle adapters, whose runs are whole, and
    /// try again.
    #[error("placing an adapter: {0}")]
    AdapterPages(#[from] crate::kv::PageError),
    /// A step could not read an adapter's weights (its file went bad while the workers read
    /// it): the step did not advance; its other sequences can run again without this one's.
    #[error("adapter {adapter}: {message}")]
    AdapterUnreadable { adapter: AdapterId, message: String },
    #[error("weight conversion failed: {0}")]
    Weights(#[from] thaw_kernels::KernelError),
}

/// Result alias for the runtime.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
