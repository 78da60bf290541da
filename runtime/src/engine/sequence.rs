//! What the engine knows about one sequence, and what a step plan and a step's output say.
use crate::ids::{AdapterId, Generation, SeqId};
use crate::kv::{BlockHash, KvBlocks, PrefixKey};
use crate::sampling::{SampledToken, Sampler, SamplingParams};

/// Everything a request asks of the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceParams {
    pub prompt: Vec<u32>,
    pub adapter: Option<AdapterId>,
    /// The loaded generation of `adapter`: the prefix cache keys by (adapter, generation), so
    /// KV computed under a replaced generation is never reused.
    pub adapter_generation: Generation,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Extra token ids that end the sequence (besides the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating through EOS (vLLM's `ignore_eos`, used by benchmarks).
    pub ignore_eos: bool,
    /// Score the prompt too (vLLM's `prompt_logprobs`): the log-probability of every prompt
    /// token after the first given the tokens before it, with this many top alternatives
    /// (`Some(0)`: the prompt token's own logprob only). None costs nothing.
    pub prompt_logprobs: Option<usize>,
}

impl Default for SequenceParams {
    fn default() -> Self {
        Self {
            prompt: Vec::new(),
            adapter: None,
            adapter_generation: Generation::default(),
            sampling: SamplingParams::default(),
            max_new_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prompt_logprobs: None,
        }
    }
}

/// Why a sequence ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS or stop token was generated (the token is included in the output).
    Stop(u32),
    /// `max_new_tokens` reached, or the context is full.
    Length,
}

/// One entry of a step plan: feed the next `num_tokens` not-yet-computed tokens of `seq`.
/// For a sequence in prefill that is a chunk of its prompt; in decode it is 1.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PlanItem {
    pub seq: SeqId,
    pub num_tokens: usize,
}

/// What the scheduler asks one step to do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub items: Vec<PlanItem>,
    /// Return each sampled row's full logits (oracle tests).
    pub return_logits: bool,
}

/// A sequence that produced a token this step.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqOutput {
    pub seq: SeqId,
    pub token: SampledToken,
    /// Set when this token ended the sequence; the engine has already freed its KV.
    pub finish: Option<FinishReason>,
    pub logits: Option<Vec<f32>>,
    /// With [`SequenceParams::prompt_logprobs`], on the sequence's first output: one entry per
    /// prompt token after the first, in order (`id` is the prompt token). The first prompt
    /// token has none, as OpenAI reports `null` for it. Empty on every other output.
    pub prompt_logprobs: Vec<SampledToken>,
}

/// The engine's record of a live sequence.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    pub adapter: Option<AdapterId>,
    pub sampler: Sampler,
    pub max_new_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub kv: KvBlocks,
    /// Top alternatives per scored prompt token; None = the prompt is not scored.
    pub prompt_logprobs: Option<usize>,
    /// Prompt tokens scored so far (chunk by chunk), handed out with the first output.
    pub prompt_scored: Vec<SampledToken>,
    /// Its prefix-cache key; None when it neither reuses nor publishes cached blocks (prefix
    /// caching off, or prompt logprobs asked for: every prompt token must be computed).
    pub prefix: Option<PrefixKey>,
    /// Hashes of its full blocks registered (or matched) so far.
    pub hashes: Vec<BlockHash>,
    /// The cache entry standing for its last registered block (0: none yet); None once its
    /// chain stops being cacheable (a hash taken by other content).
    pub chain: Option<u64>,
    /// Prompt tokens its admission found cached (the last admission's, after a preemption).
    pub cached_tokens: usize,
    /// Preempted and not resumed: it holds no KV and computes nothing, so its adapter may
    /// leave the device meanwhile (it must be registered again to resume).
    pub preempted: bool,
}

impl Sequence {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}
