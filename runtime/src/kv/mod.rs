//! Paged KV bookkeeping: which physical blocks each sequence holds, and which full blocks are
//! kept as a prefix cache for later requests (vLLM V1's automatic prefix caching).
//!
//! The storage itself belongs to the backend (one K and one V buffer per layer, each
//! `[num_blocks, block_size, kv_heads, head_dim]`); this module only decides which physical
//! blocks a sequence owns. A [`KvBlocks`] guard is the only way to hold blocks: dropping it
//! releases them, so a cancelled or failed sequence can never leak KV.
//!
//! - [`blocks`]: the pool — reference counts, blocks allocated on demand, unreferenced cached
//!   blocks kept and evicted least recently used first, and a step fence so that no block is
//!   shared or reused before the step writing it has finished.
//! - [`adapter_pages`]: which pages (runs of blocks) adapters' device images occupy on a GPU,
//!   so adapters live in the same budget as KV (pure, property-tested).
//! - [`prefix`]: the hash chain over full blocks of token ids, keyed by the adapter and its
//!   generation ([`PrefixKey`]): base-model requests share only with each other.
//!
//! What to admit, whom to preempt and when to evict adapters are the server's decisions; this
//! module is the mechanism they drive.
pub mod adapter_pages;
pub mod blocks;
pub mod prefix;

pub use adapter_pages::{AdapterPages, PageError};
pub use blocks::{BlockAllocator, KvBlocks, KvUsage};
pub use prefix::{chain_hashes, BlockHash, PrefixKey};
