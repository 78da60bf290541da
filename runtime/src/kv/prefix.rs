//! The prefix cache's keys: a hash chain over full blocks of token ids.
//!
//! Block `i`'s hash covers the hash of block `i - 1`, the [`PrefixKey`] and the block's token
//! ids, so equal hashes mean (barring a collision) an equal prefix computed under the same
//! adapter generation. The pool never trusts a hash alone: it confirms every match by the
//! block's token ids, its key and the cache entry of its parent block.
use std::hash::{Hash, Hasher};

use crate::ids::{AdapterId, Generation};

/// What a cached block's KV depends on besides its tokens: the adapter (its LoRA deltas on
/// k and v, and on every earlier layer) and which loaded generation of it. `None` is the base
/// model, shared by base-model requests only.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    pub adapter: Option<(AdapterId, Generation)>,
}

impl PrefixKey {
    pub fn base() -> Self {
        Self::default()
    }

    pub fn adapter(id: AdapterId, generation: Generation) -> Self {
        Self {
            adapter: Some((id, generation)),
        }
    }
}

/// The chained hash of one full block.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// The hash of a block given its parent's hash (None for the first block).
pub fn block_hash(parent: Option<BlockHash>, key: PrefixKey, tokens: &[u32]) -> BlockHash {
    // SipHash with fixed keys: stable within the process, which is all the cache needs.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    parent.map(|p| p.0).hash(&mut h);
    key.hash(&mut h);
    tokens.hash(&mut h);
    BlockHash(h.finish())
}

/// Hashes of the full blocks of `tokens` from block `from` on (`prev`: block `from - 1`'s
/// hash), appended to `out`. A trailing partial block is not hashed.
pub fn extend_hashes(
    out: &mut Vec<BlockHash>,
    key: PrefixKey,
    tokens: &[u32],
    block_size: usize,
    upto_blocks: usize,
) {
    let full = (tokens.len() / block_size).min(upto_blocks);
    for i in out.len()..full {
        let parent = i.checked_sub(1).map(|p| out[p]);
        let h = block_hash(parent, key, &tokens[i * block_size..(i + 1) * block_size]);
        out.push(h);
    }
}

/// Hashes of every full block of `tokens`.
pub fn chain_hashes(key: PrefixKey, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut v = Vec::with_capacity(tokens.len() / block_size);
    extend_hashes(&mut v, key, tokens, block_size, usize::MAX);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_every_earlier_token_and_the_key() {
        let toks: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 97).collect();
        let base = chain_hashes(PrefixKey::base(), &toks, 8);
        assert_eq!(base.len(), 5, "40 tokens: five full blocks of 8");
        let a1 = chain_hashes(PrefixKey::adapter(AdapterId(1), Generation(1)), &toks, 8);
        let a1b = chain_hashes(PrefixKey::adapter(AdapterId(1), Generation(2)), &toks, 8);
        assert!(base.iter().zip(&a1).all(|(x, y)| x != y));
        assert!(
            a1.iter().zip(&a1b).all(|(x, y)| x != y),
            "a reload is a new key"
        );
        let mut other = toks.clone();
        other[3] ^= 1;
        let o = chain_hashes(PrefixKey::base(), &other, 8);
        assert!(
            base.iter().zip(&o).all(|(x, y)| x != y),
            "a change in block 0 changes every later hash"
        );
        let mut tail = toks.clone();
        tail[39] ^= 1;
        let t = chain_hashes(PrefixKey::base(), &tail, 8);
        assert_eq!(base[..4], t[..4]);
        assert_ne!(base[4], t[4]);
        let mut inc = Vec::new();
        extend_hashes(&mut inc, PrefixKey::base(), &toks[..20], 8, usize::MAX);
        extend_hashes(&mut inc, PrefixKey::base(), &toks, 8, 4);
        assert_eq!(inc, base[..4]);
    }
}
