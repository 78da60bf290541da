//! Thaw's engine: the model, the backends, the paged KV cache, adapters and one engine step.
//!
//! Owns *how* things run: loading HF models and PEFT adapters, laying out a step's rows,
//! running the forward on a [`backend::Backend`], sampling. It must not decide *what* runs —
//! scheduling, caching and routing policy live in the server — and knows nothing of HTTP.
pub mod adapter;
pub mod backend;
pub mod engine;
pub mod error;
pub mod ids;
pub mod kv;
pub mod microbench;
pub mod model;
pub mod residency;
pub mod sampling;
pub mod upload;

pub use error::{Result, RuntimeError};
