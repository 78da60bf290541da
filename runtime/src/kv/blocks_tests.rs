use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::ids::Generation;
use crate::kv::prefix::{chain_hashes, PrefixKey};

#[test]
fn grow_and_free() {
    let a = BlockAllocator::new(8, 16);
    let mut s = a.empty();
    a.grow_to(&mut s, 17).unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(a.usage().used_blocks, 2);
    a.grow_to(&mut s, 32).unwrap();
    assert_eq!(s.len(), 2, "32 tokens fit in two 16-slot blocks");
    let err = a.grow_to(&mut s, 16 * 9).unwrap_err();
    assert!(matches!(
        err,
        RuntimeError::KvExhausted {
            needed: 7,
            free: 6,
            total: 8
        }
    ));
    assert_eq!(s.len(), 2, "a failed grow allocates nothing");
    drop(s);
    assert_eq!(a.usage().used_blocks, 0);
}

/// Writes `tokens` into a fresh list and registers its full blocks, as the engine does after
/// the step that computed them.
fn compute(a: &BlockAllocator, key: PrefixKey, tokens: &[u32]) -> KvBlocks {
    let mut s = a.empty();
    a.grow_to(&mut s, tokens.len()).unwrap();
    let mut parent = 0;
    for (i, h) in chain_hashes(key, tokens, a.block_size())
        .into_iter()
        .enumerate()
    {
        let t = &tokens[i * a.block_size()..(i + 1) * a.block_size()];
        parent = a.register(&s, i, h, key, t, parent).unwrap();
    }
    s
}

#[test]
fn a_released_prefix_is_reused_then_evicted_lru() {
    let a = BlockAllocator::new(6, 4);
    let key = PrefixKey::adapter(AdapterId(3), Generation(1));
    let toks: Vec<u32> = (0..10).collect();
    let first = compute(&a, key, &toks);
    let held: Vec<_> = first.blocks().to_vec();
    drop(first);
    let u = a.usage();
    assert_eq!(
        (u.used_blocks, u.cached_blocks),
        (0, 2),
        "two full blocks cached"
    );
    let hashes = chain_hashes(key, &toks, 4);
    let m = a.lookup(key, &hashes, &toks, usize::MAX);
    assert_eq!(m.blocks, held[..2]);
    let other = PrefixKey::adapter(AdapterId(4), Generation(1));
    let hashes_other = chain_hashes(other, &toks, 4);
    assert!(a.lookup(other, &hashes_other, &toks, 9).blocks.is_empty());
    let mut s = a.empty();
    a.share(&mut s, &m).unwrap();
    assert_eq!(a.usage().used_blocks, 2);
    drop(s);
    // Fill the pool: the cached blocks are the last to go, then go.
    let mut big = a.empty();
    a.grow_to(&mut big, 16).unwrap();
    assert_eq!(a.usage().cached_blocks, 2, "empty blocks are taken first");
    a.grow_to(&mut big, 24).unwrap();
    assert_eq!(a.usage().cached_blocks, 0);
    assert!(a.lookup(key, &hashes, &toks, 9).blocks.is_empty());
}

#[test]
fn lowering_the_capacity_evicts_cached_blocks_and_forgetting_an_adapter_drops_its_own() {
    let a = BlockAllocator::new(10, 2);
    let k1 = PrefixKey::adapter(AdapterId(1), Generation(1));
    let toks: Vec<u32> = (0..8).collect();
    drop(compute(&a, k1, &toks));
    drop(compute(&a, PrefixKey::base(), &toks));
    assert_eq!(a.usage().cached_blocks, 8);
    assert_eq!(a.set_capacity(6), 2);
    assert_eq!(a.usage().cached_blocks, 6);
    assert_eq!(
        a.forget_adapter(AdapterId(1)),
        2,
        "its two newest cached blocks"
    );
    let h = chain_hashes(k1, &toks, 2);
    assert!(a.lookup(k1, &h, &toks, 9).blocks.is_empty());
    let hb = chain_hashes(PrefixKey::base(), &toks, 2);
    assert_eq!(a.lookup(PrefixKey::base(), &hb, &toks, 9).blocks.len(), 4);
    let mut s = a.empty();
    assert!(
        a.grow_to(&mut s, 14).is_err(),
        "7 blocks above a capacity of 6"
    );
    a.grow_to(&mut s, 12).unwrap();
    assert_eq!(a.usage().cached_blocks, 0);
}

/// The model of one pool: what each live sequence holds, and what content each block
/// carries (the key and the whole token prefix up to its end).
#[derive(Clone, Debug)]
enum Op {
    /// Sequence `seq` (re)starts with prompt `prompt` of key `key`, sharing what is cached.
    Start {
        seq: usize,
        key: u8,
        prompt: u8,
    },
    /// It computes `n` more tokens (one step).
    Step {
        seq: usize,
        n: usize,
    },
    Drop {
        seq: usize,
    },
    Capacity {
        cap: usize,
    },
    Forget {
        key: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..5, 0u8..3, 0u8..4).prop_map(|(seq, key, prompt)| Op::Start { seq, key, prompt }),
        (0usize..5, 1usize..9).prop_map(|(seq, n)| Op::Step { seq, n }),
        (0usize..5).prop_map(|seq| Op::Drop { seq }),
        (4usize..24).prop_map(|cap| Op::Capacity { cap }),
        (1u8..3).prop_map(|key| Op::Forget { key }),
    ]
}

struct Live {
    key: PrefixKey,
    tokens: Vec<u32>,
    computed: usize,
    kv: KvBlocks,
    parent: u64,
    registered: usize,
}

/// Token streams with shared prefixes: prompts 0 and 1 agree on their first 7 tokens.
fn prompt_tokens(p: u8) -> Vec<u32> {
    let mut t: Vec<u32> = (0..30).map(|i| (i * 5 + 1) % 23).collect();
    if p >= 2 {
        t[2] = 99;
    }
    if p % 2 == 1 {
        t[7] = 77;
    }
    t
}

fn key_of(k: u8, generation: u32) -> PrefixKey {
    match k {
        0 => PrefixKey::base(),
        k => PrefixKey::adapter(AdapterId(k as u32), Generation(generation)),
    }
}

proptest! {
    /// Whatever the operations: no block is freed or reused while referenced, the pool is
    /// never over-committed, a shared chain always carries exactly the key and tokens of the
    /// sharer, and a block is shared or reused only after the step writing it has ended.
    #[test]
    fn pool_invariants(ops in proptest::collection::vec(op(), 1..80)) {
        const BS: usize = 3;
        let a = BlockAllocator::new(20, BS);
        let mut seqs: Vec<Option<Live>> = (0..5).map(|_| None).collect();
        // Block → (key, token prefix through its end) it holds, once written.
        let mut content: HashMap<BlockIdx, (PrefixKey, Vec<u32>)> = HashMap::new();
        // Each adapter's loaded generation: forgetting one (an unload) makes the next load a
        // new generation.
        let mut gens = [1u32; 3];
        for op in ops {
            match op {
                Op::Start { seq, key, prompt } => {
                    seqs[seq] = None;
                    let key = key_of(key, gens[key as usize]);
                    let tokens = prompt_tokens(prompt);
                    let hashes = chain_hashes(key, &tokens, BS);
                    let m = a.lookup(key, &hashes, &tokens, (tokens.len() - 1) / BS);
                    let mut kv = a.empty();
                    if a.share(&mut kv, &m).is_err() {
                        prop_assert!(kv.is_empty());
                        continue;
                    }
                    for (i, b) in m.blocks.iter().enumerate() {
                        let want = (key, tokens[..(i + 1) * BS].to_vec());
                        prop_assert_eq!(content.get(b), Some(&want), "block {:?} reused with other content", b);
                    }
                    let n = m.blocks.len();
                    seqs[seq] = Some(Live {
                        key, tokens, computed: n * BS, kv, parent: m.last_serial, registered: n,
                    });
                }
                Op::Step { seq, n } => {
                    let Some(s) = seqs[seq].as_mut() else { continue };
                    let n = n.min(s.tokens.len() - s.computed);
                    if n == 0 { continue; }
                    let before: HashSet<BlockIdx> = s.kv.blocks().iter().copied().collect();
                    a.begin_step();
                    if a.grow_to(&mut s.kv, s.computed + n).is_err() {
                        a.end_step();
                        continue;
                    }
                    // New blocks belong to no one else.
                    let others: HashSet<BlockIdx> = seqs.iter().enumerate()
                        .filter(|(i, _)| *i != seq)
                        .filter_map(|(_, l)| l.as_ref())
                        .flat_map(|l| l.kv.blocks().iter().copied())
                        .collect();
                    let s = seqs[seq].as_mut().unwrap();
                    for b in s.kv.blocks() {
                        if !before.contains(b) {
                            prop_assert!(!others.contains(b), "block {:?} reused while referenced", b);
                            content.remove(b);
                        }
                    }
                    // The step writes its tokens; whatever block it wrote is not visible
                    // to a lookup until the step ends.
                    s.computed += n;
                    let full = s.computed / BS;
                    for i in 0..full {
                        content.insert(s.kv.blocks()[i], (s.key, s.tokens[..(i + 1) * BS].to_vec()));
                    }
                    let hashes = chain_hashes(s.key, &s.tokens, BS);
                    for (i, &h) in hashes.iter().enumerate().take(full).skip(s.registered) {
                        match a.register(&s.kv, i, h, s.key, &s.tokens[i * BS..(i + 1) * BS], s.parent) {
                            Some(p) => { s.parent = p; s.registered = i + 1; }
                            None => break,
                        }
                    }
                    let m = a.lookup(s.key, &hashes, &s.tokens, usize::MAX);
                    let fresh: Vec<_> = s.kv.blocks().iter().filter(|b| !before.contains(b)).collect();
                    prop_assert!(m.blocks.iter().all(|b| !fresh.contains(&b)), "visible before its step ended");
                    a.end_step();
                }
                Op::Drop { seq } => seqs[seq] = None,
                Op::Capacity { cap } => { a.set_capacity(cap); }
                Op::Forget { key } => {
                    a.forget_adapter(AdapterId(key as u32));
                    let old = key_of(key, gens[key as usize]);
                    for p in 0..4 {
                        let t = prompt_tokens(p);
                        let h = chain_hashes(old, &t, BS);
                        prop_assert!(a.lookup(old, &h, &t, usize::MAX).blocks.is_empty(),
                            "a forgotten adapter's blocks are still found");
                    }
                    gens[key as usize] += 1;
                }
            }
            // Invariants after every operation.
            let u = a.usage();
            let mut refs: HashMap<BlockIdx, usize> = HashMap::new();
            for l in seqs.iter().flatten() {
                let mut own = HashSet::new();
                for b in l.kv.blocks() {
                    prop_assert!(own.insert(*b), "a list holds block {:?} twice", b);
                    *refs.entry(*b).or_default() += 1;
                }
            }
            prop_assert_eq!(u.used_blocks, refs.len(), "used = distinct held blocks");
            prop_assert!(u.used_blocks + u.cached_blocks <= u.total_blocks);
            prop_assert!(u.cached_blocks == 0 || u.used_blocks + u.cached_blocks <= u.capacity,
                "cached blocks kept beyond the capacity: {:?}", u);
        }
    }

    /// Block tables of unshared sequences never alias.
    #[test]
    fn tables_never_alias(ops in proptest::collection::vec((0usize..6, 0usize..80), 1..60)) {
        let a = BlockAllocator::new(24, 8);
        let mut seqs: Vec<Option<KvBlocks>> = (0..6).map(|_| None).collect();
        for (i, tokens) in ops {
            if tokens % 5 == 0 {
                seqs[i] = None;
            } else {
                let s = seqs[i].get_or_insert_with(|| a.empty());
                let before = s.len();
                match a.grow_to(s, tokens) {
                    Ok(()) => prop_assert!(s.len() * 8 >= tokens),
                    Err(_) => prop_assert_eq!(s.len(), before),
                }
            }
            let mut seen = HashSet::new();
            let mut live = 0;
            for s in seqs.iter().flatten() {
                for b in s.blocks() {
                    prop_assert!(seen.insert(*b), "block {:?} owned twice", b);
                    prop_assert!((b.0 as usize) < 24);
                }
                live += s.len();
            }
            prop_assert_eq!(a.usage().used_blocks, live);
        }
    }
}

#[test]
fn a_block_released_during_a_step_is_reused_only_after_it() {
    let a = BlockAllocator::new(2, 2);
    let mut x = a.empty();
    a.grow_to(&mut x, 4).unwrap();
    a.begin_step();
    drop(x);
    let mut y = a.empty();
    assert!(
        a.grow_to(&mut y, 1).is_err(),
        "the released blocks are still being written"
    );
    a.end_step();
    a.grow_to(&mut y, 4).unwrap();
}
