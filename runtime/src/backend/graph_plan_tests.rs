use super::*;
use crate::backend::SeqSlice;
use proptest::prelude::*;
use std::collections::HashSet;

#[test]
fn capture_sizes_follow_vllm() {
    assert_eq!(capture_sizes(32), vec![1, 2, 4, 8, 16, 24, 32]);
    assert_eq!(capture_sizes(20), vec![1, 2, 4, 8, 16]);
    let all = capture_sizes(10_000);
    assert_eq!(all.last(), Some(&MAX_CAPTURE_SIZE));
    assert!(all.contains(&256) && all.contains(&272) && !all.contains(&264));
    assert_eq!(capture_sizes(1), vec![1]);
    assert_eq!(bucket_for(3, &capture_sizes(32)), Some(4));
    assert_eq!(bucket_for(33, &capture_sizes(32)), None);
}

#[test]
fn rank_classes_are_powers_of_two_from_8() {
    let got: Vec<usize> = [0, 1, 8, 9, 16, 17, 64, 65, 256]
        .iter()
        .map(|&r| rank_class(r))
        .collect();
    assert_eq!(got, vec![0, 8, 8, 16, 16, 32, 64, 128, 256]);
}

#[test]
fn the_lifecycle_is_warmup_capture_replay_or_eager_after_a_failure() {
    let mut state = None;
    let mut phases = Vec::new();
    for _ in 0..4 {
        let p = next_phase(state).unwrap();
        phases.push(p);
        state = Some(after_phase(p, true));
    }
    use GraphPhase::*;
    assert_eq!(phases, vec![Warmup, Capture, Replay, Replay]);
    let failed = after_phase(Capture, false);
    assert_eq!(failed, KeyState::Failed);
    assert_eq!(next_phase(Some(failed)), None);
}

/// A decode step of sequences with the given (context position, blocks) and adapters.
fn decode_step(seqs: &[(usize, usize, Option<u32>)]) -> (StepLayout, LoraLayout) {
    let mut step = StepLayout::default();
    let mut lora = LoraLayout::default();
    let mut next_block = 0u32;
    for (i, &(pos, nb, a)) in seqs.iter().enumerate() {
        let b0 = step.block_tables.len();
        step.block_tables
            .extend((0..nb as u32).map(|k| next_block + k));
        next_block += nb as u32;
        step.seqs.push(SeqSlice {
            rows: i..i + 1,
            start_pos: pos,
            blocks: b0..b0 + nb,
        });
        step.token_ids.push(3 + i as u32);
        step.positions.push(pos);
        step.logit_rows.push(i);
        lora.row_adapter.push(a);
        if let Some(a) = a {
            match lora.segments.last_mut() {
                Some((r, last)) if *last == a => r.end = i + 1,
                _ => lora.segments.push((i..i + 1, a)),
            }
        }
    }
    (step, lora)
}

fn policy() -> GraphPolicy {
    GraphPolicy::new(32, 64, 16)
}

#[test]
fn steps_a_graph_cannot_run_say_why() {
    let (step, _) = decode_step(&[(5, 1, None), (20, 2, Some(0))]);
    let shape = StepShape::of(&step, false, false, 16);
    assert_eq!(
        decide(&shape, &policy()),
        Ok(GraphKey {
            bucket: 2,
            lora_rank: 16
        })
    );
    let eager = |s: StepShape| decide(&s, &policy()).unwrap_err();
    assert_eq!(eager(StepShape::of(&step, true, false, 16)), Eager::Cold);
    assert_eq!(
        eager(StepShape::of(&step, false, true, 16)),
        Eager::ScoresPrompt
    );
    assert_eq!(
        eager(StepShape::of(&step, false, false, 300)),
        Eager::RankTooLarge(300)
    );
    let mut prefill = step.clone();
    prefill.token_ids.push(1);
    prefill.positions.push(21);
    prefill.seqs[1].rows = 1..3;
    assert_eq!(
        eager(StepShape::of(&prefill, false, false, 0)),
        Eager::Prefill
    );
    let mut partial = step.clone();
    partial.logit_rows.truncate(1);
    assert_eq!(
        eager(StepShape::of(&partial, false, false, 0)),
        Eager::PartialSampling
    );
    let big: Vec<_> = (0..33).map(|_| (1, 1, None)).collect();
    let (big, _) = decode_step(&big);
    assert_eq!(
        eager(StepShape::of(&big, false, false, 0)),
        Eager::TooLarge {
            rows: 33,
            largest: 32
        }
    );
    assert_eq!(
        eager(StepShape::of(&StepLayout::default(), false, false, 0)),
        Eager::Empty
    );
}

proptest! {
    /// The bucket fits the batch, is the smallest captured size that does, and pads at
    /// most 7 rows up to 256 sequences (15 above); batches past the largest run eagerly.
    #[test]
    fn bucket_is_the_tightest_captured_size(max in 1usize..1000, batch in 0usize..1100) {
        let sizes = capture_sizes(max);
        prop_assert!(sizes.windows(2).all(|w| w[0] < w[1]));
        prop_assert!(sizes.iter().all(|&s| s <= max.min(MAX_CAPTURE_SIZE)));
        match bucket_for(batch, &sizes) {
            Some(b) => {
                prop_assert!(batch >= 1 && b >= batch && sizes.contains(&b));
                prop_assert!(sizes.iter().all(|&s| s < batch || s >= b));
                let slack = if batch <= 4 { 1 } else if b <= 256 { 7 } else { 15 };
                prop_assert!(b - batch <= slack, "batch {} → {}", batch, b);
            }
            None => prop_assert!(batch == 0 || batch > *sizes.last().unwrap()),
        }
    }

    /// A graph is chosen exactly for warm decode steps that fit: then its bucket is the
    /// tightest, its rank class covers every adapter, and its padded tables fit the buffer.
    #[test]
    fn a_graph_only_for_decode_steps_that_fit(
        seqs in prop::collection::vec((0usize..64, prop::option::of(0u32..3)), 0..40),
        cold in any::<bool>(),
        scores in any::<bool>(),
        rank in 0usize..300,
        max_bs in 1usize..48,
    ) {
        let seqs: Vec<_> = seqs.iter().map(|&(p, a)| (p, p / 16 + 1, a)).collect();
        let (step, _) = decode_step(&seqs);
        let p = GraphPolicy::new(max_bs, 64, 16);
        let shape = StepShape::of(&step, cold, scores, rank);
        match decide(&shape, &p) {
            Ok(k) => {
                prop_assert!(!cold && !scores && rank <= MAX_GRAPH_RANK);
                prop_assert_eq!(Some(k.bucket), bucket_for(seqs.len(), &p.sizes));
                prop_assert!(k.lora_rank >= rank && (rank == 0) == (k.lora_rank == 0));
                prop_assert!(k.lora_rank <= 2 * rank.max(4));
                let words = step.block_tables.len() + k.bucket - seqs.len();
                prop_assert!(words <= p.meta_layout().table_capacity());
            }
            Err(_) => prop_assert!(
                seqs.is_empty() || cold || scores || rank > MAX_GRAPH_RANK
                    || seqs.len() > p.max_bucket()
            ),
        }
    }

    /// Padding keeps the real rows as they were and adds inert ones: their KV goes to the
    /// scratch block only (no two real rows share a slot, none is the scratch block's), they
    /// attend to that one slot, have no adapter, and their logits come after the real ones.
    /// The filled metadata holds exactly what the eager path builds for the padded step, in
    /// regions that tile the buffer.
    #[test]
    fn padded_metadata_is_the_eager_metadata_of_the_padded_step(
        seqs in prop::collection::vec((0usize..60, prop::option::of(0u32..3)), 1..30),
        extra in 0usize..9,
        seed in 0u64..1000,
    ) {
        let bs = 16;
        let seqs: Vec<_> = seqs.iter().map(|&(p, a)| (p, p / bs + 1, a)).collect();
        let (mut step, mut lora) = decode_step(&seqs);
        let n = seqs.len();
        let scratch = step.block_tables.len() as u32;
        let num_blocks = scratch as usize + 1;
        let (before, lora_before) = (step.clone(), lora.clone());
        let bucket = n + extra;
        pad_step(&mut step, &mut lora, bucket, scratch);
        prop_assert_eq!(step.rows(), bucket);
        prop_assert_eq!(&step.token_ids[..n], &before.token_ids[..]);
        prop_assert_eq!(&step.seqs[..n], &before.seqs[..]);
        prop_assert_eq!(&lora.segments, &lora_before.segments);
        prop_assert_eq!(step.logit_rows.clone(), (0..bucket).collect::<Vec<_>>());
        let mut attn = AttnHost::default();
        attn.build(&step, bs, num_blocks, 16);
        let real: HashSet<u32> = attn.slots[..n].iter().copied().collect();
        prop_assert_eq!(real.len(), n);
        let scratch_slots = scratch * bs as u32..(scratch + 1) * bs as u32;
        prop_assert!(real.iter().all(|s| !scratch_slots.contains(s)));
        for r in n..bucket {
            prop_assert_eq!(attn.slots[r], scratch * bs as u32);
            prop_assert_eq!(&attn.decode[3 * r..3 * r + 3], &[(before.block_tables.len() + r - n) as u32, 0, r as u32][..]);
            prop_assert_eq!(lora.row_adapter[r], None);
        }
        let addr = |i: u32| Some(0x7000_0000_0000 + (seed << 12) + u64::from(i) * 0x1000);
        let mut lh = LoraHost::default();
        lh.build(&lora, addr);
        // One buffer for graphs of up to `bucket + 3` rows.
        let cap = bucket + 3;
        let l = GraphMetaLayout::new(cap, cap * 4);
        let regions = [
            (l.row_tables, 2 * cap), (l.tokens, cap), (l.positions, cap), (l.slots, cap),
            (l.decode, 3 * cap), (l.logit_rows, cap), (l.tables, cap * 4),
        ];
        let mut at = 0;
        for (o, len) in regions {
            prop_assert_eq!(o, at);
            at += len;
        }
        prop_assert_eq!(at, l.len);
        prop_assert_eq!(l.row_tables % 2, 0);
        let mut buf = vec![0xdead_beef; l.len];
        let used = l.fill(&step, &attn, &lh, &mut buf).unwrap();
        prop_assert_eq!(used, l.tables + attn.tables.len());
        for r in 0..bucket {
            let t = u64::from(buf[l.row_tables + 2 * r]) | u64::from(buf[l.row_tables + 2 * r + 1]) << 32;
            prop_assert_eq!(t, lora.row_adapter[r].and_then(addr).unwrap_or(0));
            prop_assert_eq!(buf[l.tokens + r], step.token_ids[r]);
            prop_assert_eq!(buf[l.positions + r] as usize, step.positions[r]);
            prop_assert_eq!(buf[l.slots + r], attn.slots[r]);
            prop_assert_eq!(buf[l.logit_rows + r] as usize, r);
        }
        prop_assert_eq!(&buf[l.decode..l.decode + 3 * bucket], &attn.decode[..]);
        prop_assert_eq!(&buf[l.tables..used], &step.block_tables[..]);
        // Nothing past what the step uses was written (the copy stops at `used`).
        prop_assert!(buf[used..].iter().all(|&w| w == 0xdead_beef));
    }
}

#[test]
fn a_step_that_does_not_fit_is_refused() {
    let (mut step, mut lora) = decode_step(&[(0, 1, None), (3, 1, None), (7, 1, None)]);
    let l = GraphMetaLayout::new(2, 8);
    let mut attn = AttnHost::default();
    attn.build(&step, 16, 4, 16);
    let mut lh = LoraHost::default();
    lh.build(&lora, |_| None);
    let mut buf = vec![0; l.len];
    let e = l.fill(&step, &attn, &lh, &mut buf).unwrap_err();
    assert!(e.contains("do not fit graphs of at most 2"), "{e}");
    // A prefill row is refused too.
    step.token_ids.push(9);
    step.positions.push(1);
    step.seqs[0].rows = 0..2;
    for s in &mut step.seqs[1..] {
        s.rows = s.rows.start + 1..s.rows.end + 1;
    }
    lora.row_adapter.push(None);
    let l = GraphMetaLayout::new(8, 8);
    attn.build(&step, 16, 4, 16);
    lh.build(&lora, |_| None);
    let mut buf = vec![0; l.len];
    let e = l.fill(&step, &attn, &lh, &mut buf).unwrap_err();
    assert!(e.contains("not a decode step"), "{e}");
}
