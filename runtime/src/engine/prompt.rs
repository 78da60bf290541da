//! Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): the rows of a
//! prefill chunk also score the prompt token that follows each of them.
//!
//! The layout marks those rows while it is built; after the forward their logits are computed
//! in passes of at most [`super::forward::Workspace::logit_cap`] rows, on top of the step's
//! sample rows, and scored like a sampled token ([`crate::sampling::score_token`]). Scores
//! collect on the sequence and leave with its first output, so how the prompt was chunked
//! does not show.
use super::{forward, Engine};
use crate::backend::Backend;
use crate::sampling::score_token;

impl<B: Backend> Engine<B> {
    /// Scores the prompt tokens this step's rows predict. Costs nothing when no sequence of
    /// the step asked for prompt logprobs.
    pub(super) fn score_prompt(&mut self) {
        let vocab = self.config.vocab_size;
        let cap = self.ws.logit_cap();
        for (rows, targets) in self
            .prompt_rows
            .chunks(cap)
            .zip(self.prompt_targets.chunks(cap))
        {
            forward::logits(
                &mut self.backend,
                &self.config,
                &self.model,
                &mut self.ws,
                rows,
                &mut self.prompt_logits,
            );
            for (row, &(seq, token)) in self.prompt_logits.chunks_exact(vocab).zip(targets) {
                let s = self.seqs.get_mut(&seq).expect("planned sequences are live");
                let top = s.prompt_logprobs.unwrap_or(0);
                let scored = score_token(row, token, top, &mut self.sampler_scratch);
                s.prompt_scored.push(scored);
            }
        }
    }
}
