//! Prompts of an exact token length, sent as token ids (`prompt: [ids]`, which OpenAI-compatible
//! servers accept) so the server does not re-tokenize them into a different length. With the
//! model's `tokenizer.json` the ids are windows of encoded English text; without one they are
//! random ids from a range every byte-level vocabulary has.
use std::path::{Path, PathBuf};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const TEXT: &str = "The river ran low that autumn, and the mill stood quiet for the first time \
in living memory. People came down from the hills to see the stones at the bottom of the race, \
green with moss, and the children counted the fish caught in the shallow pools. The miller said \
little. He walked the bank each morning with his hands behind his back, reading the water the \
way other men read letters, and each evening he wrote a line in a ledger that nobody else was \
allowed to open. When the rains finally returned in the second week of November, the wheel \
turned again with a groan that could be heard in the village square, and the baker, who had \
been buying flour from the town at twice the price, laughed out loud in front of his ovens. ";

/// Where prompt token ids come from.
#[derive(Clone, Debug)]
pub enum PromptSource {
    /// A stream of real token ids to cut windows from.
    Text {
        ids: Vec<u32>,
        from: PathBuf,
        tok: std::sync::Arc<tokenizers::Tokenizer>,
    },
    /// Uniform random ids in `lo..hi`.
    Random { lo: u32, hi: u32 },
}

impl PromptSource {
    /// From a `tokenizer.json` file or a directory holding one.
    pub fn from_tokenizer(path: &Path) -> anyhow::Result<Self> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let tok = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("reading the tokenizer {}", file.display()))?;
        let enc = tok
            .encode(TEXT.repeat(4), false)
            .map_err(|e| anyhow::anyhow!("encoding the prompt text: {e}"))?;
        let ids = enc.get_ids().to_vec();
        anyhow::ensure!(
            ids.len() >= 16,
            "{} encodes the prompt text to {} tokens; is it a real tokenizer?",
            file.display(),
            ids.len()
        );
        Ok(Self::Text {
            ids,
            from: file,
            tok: std::sync::Arc::new(tok),
        })
    }

    /// Byte tokens: ids 3..259 are bytes in Llama's and Thaw's vocabularies.
    pub fn random() -> Self {
        Self::Random { lo: 3, hi: 259 }
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Text { ids, from, .. } => {
                format!(
                    "windows of {} text tokens from {}",
                    ids.len(),
                    from.display()
                )
            }
            Self::Random { lo, hi } => format!("random token ids in {lo}..{hi}"),
        }
    }

    /// Prompts of the given lengths, reproducible from `seed`.
    pub fn prompts(&self, lengths: &[usize], seed: u64) -> Vec<Vec<u32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x70_72_6f_6d_70_74);
        lengths
            .iter()
            .map(|&n| match self {
                Self::Text { ids, .. } => {
                    let start = rng.random_range(0..ids.len());
                    (0..n).map(|j| ids[(start + j) % ids.len()]).collect()
                }
                Self::Random { lo, hi } => (0..n).map(|_| rng.random_range(*lo..*hi)).collect(),
            })
            .collect()
    }
}

impl PromptSource {
    /// Texts of about the given token lengths, reproducible from `seed` (for chat messages,
    /// which the server tokenizes): with a tokenizer, windows of the text's ids decoded (the
    /// server's count may differ by a token or two at the edges); without one, that many words
    /// of the text.
    pub fn texts(&self, lengths: &[usize], seed: u64) -> Vec<String> {
        match self {
            Self::Text { tok, .. } => self
                .prompts(lengths, seed)
                .iter()
                .map(|ids| tok.decode(ids, true).unwrap_or_default().trim().to_string())
                .collect(),
            Self::Random { .. } => {
                let words: Vec<&str> = TEXT.split_whitespace().collect();
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x74_65_78_74);
                lengths
                    .iter()
                    .map(|&n| {
                        let start = rng.random_range(0..words.len());
                        (0..n)
                            .map(|j| words[(start + j) % words.len()])
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_lengths_and_reproducible() {
        let s = PromptSource::random();
        let p = s.prompts(&[1, 5, 300], 7);
        assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 5, 300]);
        assert_eq!(p, s.prompts(&[1, 5, 300], 7));
        assert!(p[2].iter().all(|&t| (3..259).contains(&t)));
        let t = s.texts(&[0, 7], 3);
        assert_eq!(t[0], "");
        assert_eq!(t[1].split_whitespace().count(), 7);
        assert_eq!(t, s.texts(&[0, 7], 3));
        assert_ne!(t[1], s.texts(&[7], 4)[0]);
    }
}
