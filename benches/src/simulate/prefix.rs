//! The simulated prefix cache of one instance (issue 28's automatic prefix caching, as vLLM
//! V1 does it): full KV blocks of computed prompts (and answers) stay in the KV pool after
//! their sequence ends, keyed by adapter and the tokens before them; a request reuses the
//! longest cached chain of its prompt and prefills only the rest. Unreferenced cached blocks
//! are evicted least recently used when admission needs room.
//!
//! A chat request's prompt is a chain of segments: its adapter's system prompt, then its
//! conversation's user messages and answers, turn by turn; a segment's key is (adapter,
//! conversation, position), so two conversations of one adapter share the system prompt and
//! nothing under another adapter matches. A cache entry holds the full blocks that end inside
//! its segment (block boundaries counted from the prompt's start), so a chain's blocks are
//! exactly the full blocks of its tokens. Requests without a chat chain cache nothing.
use std::collections::HashMap;

/// Where a chat request sits in its conversation, and the lengths of its segments (tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChatTurn {
    pub conv: u32,
    /// 0-based turn.
    pub turn: u32,
    pub system: u32,
    pub user: u32,
    pub answer: u32,
}

impl ChatTurn {
    /// Prompt tokens: the system prompt, every earlier exchange and the new user message.
    pub fn prompt(&self) -> usize {
        (self.system + self.turn * (self.user + self.answer) + self.user) as usize
    }
}

/// A segment of a chain: position 0 is the adapter's system prompt (shared by its
/// conversations), position p ≥ 1 the conversation's p-th message (odd: user, even: answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub adapter: u32,
    /// The conversation, None for the system prompt.
    pub conv: Option<u32>,
    pub pos: u32,
}

/// The segments of `t`'s prompt (with its answer when `with_answer`): (key, tokens).
pub fn segments(adapter: u32, t: &ChatTurn, with_answer: bool) -> Vec<(Key, usize)> {
    let mut v = Vec::with_capacity(2 * t.turn as usize + 3);
    if t.system > 0 {
        let key = Key {
            adapter,
            conv: None,
            pos: 0,
        };
        v.push((key, t.system as usize));
    }
    let last = 2 * t.turn + 1 + u32::from(with_answer);
    for pos in 1..=last {
        let len = if pos % 2 == 1 { t.user } else { t.answer };
        let key = Key {
            adapter,
            conv: Some(t.conv),
            pos,
        };
        v.push((key, len as usize));
    }
    v
}

/// Full blocks of each segment: those that end inside it, counting from the chain's start.
pub fn segment_blocks(segs: &[(Key, usize)], block_size: usize) -> Vec<usize> {
    let bs = block_size.max(1);
    let mut cum = 0;
    segs.iter()
        .map(|(_, n)| {
            let before = cum / bs;
            cum += n;
            cum / bs - before
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    blocks: usize,
    last_used: f64,
    /// Running sequences using it: never evicted while above 0.
    refs: u32,
    pos: u32,
}

/// What a lookup found: how many leading segments are cached, and the prompt tokens the
/// request may skip (whole blocks, and never the prompt's last token, which must be computed
/// to sample the first output token, as in vLLM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Hit {
    pub segments: usize,
    pub tokens: usize,
    pub blocks: usize,
}

/// One instance's prefix cache.
#[derive(Clone, Debug, Default)]
pub struct PrefixCache {
    entries: HashMap<Key, Entry>,
    /// Blocks held by entries.
    pub blocks: usize,
    /// Blocks held by entries some running sequence uses.
    pub pinned_blocks: usize,
    /// Prompt tokens looked up at admission and found (vLLM's prefix_cache_queries/hits).
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

impl PrefixCache {
    /// The longest cached chain of `segs` (a prompt of `prompt` tokens). Pure.
    pub fn lookup(&self, segs: &[(Key, usize)], prompt: usize, block_size: usize) -> Hit {
        let bs = block_size.max(1);
        let (mut n, mut tokens) = (0, 0);
        for (k, len) in segs {
            if !self.entries.contains_key(k) {
                break;
            }
            n += 1;
            tokens += len;
        }
        let blocks = (tokens / bs).min(prompt.saturating_sub(1) / bs);
        Hit {
            segments: n,
            tokens: blocks * bs,
            blocks,
        }
    }

    /// Marks the first `n` of `segs` used by one more sequence, at `now`.
    pub fn pin(&mut self, segs: &[(Key, usize)], n: usize, now: f64) {
        for (k, _) in &segs[..n] {
            if let Some(e) = self.entries.get_mut(k) {
                if e.refs == 0 {
                    self.pinned_blocks += e.blocks;
                }
                e.refs += 1;
                e.last_used = now;
            }
        }
    }

    /// Undoes one [`pin`](Self::pin) of the first `n` of `segs`.
    pub fn unpin(&mut self, segs: &[(Key, usize)], n: usize, now: f64) {
        for (k, _) in &segs[..n] {
            if let Some(e) = self.entries.get_mut(k) {
                debug_assert!(e.refs > 0, "unpinning an unpinned entry");
                e.refs = e.refs.saturating_sub(1);
                e.last_used = now;
                if e.refs == 0 {
                    self.pinned_blocks -= e.blocks;
                }
            }
        }
    }

    /// Caches `segs[from..]` (computed by a sequence), pinned by it when `pin`; returns the
    /// blocks that became cache entries (segments already cached add none and are touched).
    pub fn insert(
        &mut self,
        segs: &[(Key, usize)],
        from: usize,
        block_size: usize,
        now: f64,
        pin: bool,
    ) -> usize {
        let blocks = segment_blocks(segs, block_size);
        let mut added = 0;
        for ((k, _), &b) in segs.iter().zip(&blocks).skip(from) {
            let e = self.entries.entry(*k).or_insert_with(|| {
                added += b;
                Entry {
                    blocks: b,
                    last_used: now,
                    refs: 0,
                    pos: k.pos,
                }
            });
            e.last_used = now;
            if pin {
                if e.refs == 0 {
                    self.pinned_blocks += e.blocks;
                }
                e.refs += 1;
            }
        }
        self.blocks += added;
        added
    }

    /// Blocks that eviction could free.
    pub fn evictable(&self) -> usize {
        self.blocks - self.pinned_blocks
    }

    /// Evicts unpinned entries, least recently used first (and of equal age the later
    /// segment first, so a chain shrinks from its end), until `need` blocks are freed or none
    /// is left; returns the blocks freed.
    pub fn evict(&mut self, need: usize) -> usize {
        if need == 0 {
            return 0;
        }
        let mut cands: Vec<(f64, u32, Key)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.refs == 0)
            .map(|(k, e)| (e.last_used, e.pos, *k))
            .collect();
        cands.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut freed = 0;
        for (_, _, k) in cands {
            if freed >= need {
                break;
            }
            if let Some(e) = self.entries.remove(&k) {
                freed += e.blocks;
            }
        }
        self.blocks -= freed;
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn turn(conv: u32, turn: u32) -> ChatTurn {
        ChatTurn {
            conv,
            turn,
            system: 100,
            user: 20,
            answer: 30,
        }
    }

    #[test]
    fn segments_and_blocks_follow_the_conversation() {
        let t = turn(3, 2);
        let s = segments(7, &t, false);
        // System prompt, u1, a1, u2, a2, u3.
        assert_eq!(s.len(), 6);
        assert_eq!(s.iter().map(|x| x.1).sum::<usize>(), t.prompt());
        assert_eq!(s[0].0.conv, None);
        assert!(s[1..].iter().all(|x| x.0.conv == Some(3)));
        assert_eq!(segments(7, &t, true).len(), 7);
        // 100 | 20 | 30 with 16-token blocks: 6 full blocks end in the first (96 tokens),
        // blocks ending at 112 in the second, 128 and 144 in the third.
        assert_eq!(segment_blocks(&s[..3], 16), vec![6, 1, 2]);
    }

    #[test]
    fn a_chain_is_reused_under_its_adapter_only_and_never_whole() {
        let mut c = PrefixCache::default();
        let t0 = turn(1, 0);
        let first = segments(5, &t0, true);
        assert_eq!(c.lookup(&first, t0.prompt(), 16), Hit::default());
        c.insert(&first, 0, 16, 1.0, false);
        // 100 + 20 + 30 = 150 tokens: 9 full blocks.
        assert_eq!(c.blocks, 9);
        let t1 = turn(1, 1);
        let next = segments(5, &t1, false);
        let h = c.lookup(&next, t1.prompt(), 16);
        assert_eq!((h.segments, h.blocks, h.tokens), (3, 9, 144));
        // Another adapter: nothing; another conversation of the adapter: the system prompt.
        assert_eq!(
            c.lookup(&segments(6, &t1, false), t1.prompt(), 16).segments,
            0
        );
        let other = segments(5, &turn(2, 1), false);
        assert_eq!(c.lookup(&other, t1.prompt(), 16).tokens, 96);
        // A prompt that is entirely cached still computes its last token (and its block):
        // 96 + 16 tokens cached, a 112-token prompt reuses 6 of its 7 blocks.
        let exact = ChatTurn {
            conv: 9,
            turn: 0,
            system: 96,
            user: 16,
            answer: 0,
        };
        let segs = segments(6, &exact, false);
        c.insert(&segs, 0, 16, 2.0, false);
        let h = c.lookup(&segs, exact.prompt(), 16);
        assert_eq!((h.segments, h.blocks, h.tokens), (2, 6, 96));
    }

    #[test]
    fn pinned_entries_survive_eviction_and_chains_shrink_from_their_end() {
        let mut c = PrefixCache::default();
        let a = segments(1, &turn(1, 0), true);
        c.insert(&a, 0, 16, 1.0, false);
        let b = segments(2, &turn(2, 0), true);
        c.insert(&b, 0, 16, 2.0, false);
        c.pin(&b, 3, 3.0);
        assert_eq!((c.blocks, c.pinned_blocks, c.evictable()), (18, 9, 9));
        // Everything unpinned goes, the pinned chain stays.
        assert_eq!(c.evict(100), 9);
        assert_eq!(c.lookup(&a, 150, 16).segments, 0);
        assert_eq!(c.lookup(&b, 150, 16).segments, 3);
        c.unpin(&b, 3, 4.0);
        // One block needed: the chain's last segment (2 blocks) goes first.
        assert_eq!(c.evict(1), 2);
        assert_eq!(c.lookup(&b, 150, 16).segments, 2);
        assert_eq!(c.blocks, 7);
    }

    proptest! {
        /// Under any sequence of inserts, pins, unpins and evictions: the block counts equal
        /// the entries' sums, a pinned entry is never evicted, a lookup's hit is a cached
        /// prefix of whole blocks shorter than the prompt.
        #[test]
        fn accounting_holds_and_pins_protect(
            ops in proptest::collection::vec((0u8..4, 0u32..3, 0u32..4, 0u32..3, 0usize..40), 1..80),
        ) {
            let mut c = PrefixCache::default();
            let mut pins: Vec<(Vec<(Key, usize)>, usize)> = Vec::new();
            let mut now = 0.0;
            for (op, adapter, conv, t, need) in ops {
                now += 1.0;
                let tt = ChatTurn { conv, turn: t, system: 40, user: 10, answer: 7 };
                let segs = segments(adapter, &tt, false);
                match op {
                    0 => { c.insert(&segments(adapter, &tt, true), 0, 16, now, false); }
                    1 => {
                        let h = c.lookup(&segs, tt.prompt(), 16);
                        c.pin(&segs, h.segments, now);
                        pins.push((segs.clone(), h.segments));
                    }
                    2 => if let Some((s, n)) = pins.pop() { c.unpin(&s, n, now); },
                    _ => { c.evict(need); }
                }
                let sum: usize = c.entries.values().map(|e| e.blocks).sum();
                let pinned: usize = c.entries.values().filter(|e| e.refs > 0).map(|e| e.blocks).sum();
                prop_assert_eq!(c.blocks, sum);
                prop_assert_eq!(c.pinned_blocks, pinned);
                for (s, n) in &pins {
                    for (k, _) in &s[..*n] {
                        prop_assert!(c.entries.contains_key(k), "a pinned entry was evicted");
                    }
                }
                let h = c.lookup(&segs, tt.prompt(), 16);
                prop_assert!(h.tokens < tt.prompt() && h.tokens % 16 == 0);
                prop_assert!(h.tokens <= segs[..h.segments].iter().map(|x| x.1).sum::<usize>());
            }
        }
    }
}
