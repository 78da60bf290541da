//! The `thaw` command line. Each subcommand is a variant of [`Command`] holding its own
//! `Args` struct; add a variant and a match arm in [`Command::run`] to add one.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use thaw_server::gen::{self, Projection, WeightDtype, PRESET_NAMES};

/// Thaw: multi-LoRA LLM serving where cold adapters do not wait.
#[derive(Debug, Parser)]
#[command(name = "thaw", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Write a seeded random HF Llama model directory (config, weights, trained tokenizer).
    GenModel(GenModelArgs),
    /// Write seeded random PEFT LoRA adapters for a model directory.
    GenAdapters(GenAdaptersArgs),
    /// Run one request end to end on the CPU engine and stream its text (no --model: the
    /// embedded demo model and its first adapter, generated once into the cache directory).
    Generate(GenerateArgs),
    /// Serve the OpenAI-compatible HTTP API (completions, chat, models, adapter load/unload,
    /// metrics); with no --model, the embedded demo model and adapters on 127.0.0.1:8000.
    Serve(Box<thaw_server::serve::ServeArgs>),
    /// A CPU LoRA worker process; spawned by the server's worker pool, not typed by hand.
    #[command(hide = true)]
    LoraWorker(thaw_cpu_lora::WorkerArgs),
}

impl Command {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            Command::GenModel(args) => args.run(),
            Command::GenAdapters(args) => args.run(),
            Command::Generate(args) => args.run(),
            Command::Serve(args) => thaw_server::serve::run((*args).resolve()?),
            Command::LoraWorker(args) => Ok(thaw_cpu_lora::worker_main(args)?),
        }
    }
}

#[derive(Debug, Args)]
pub struct GenModelArgs {
    /// Model shape: tiny (test fixture size), small (~26M params, CPU benchmarks),
    /// llama-7b-shape (Llama-2-7B shapes, 13.5 GB in bf16).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(PRESET_NAMES))]
    pub preset: String,
    /// Output directory (created if missing; weight files already there are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of all weights; the same seed writes byte-identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Weight dtype [default: f32 for tiny and small, bf16 for llama-7b-shape].
    #[arg(long)]
    pub dtype: Option<WeightDtype>,
    /// Split the weights into shards of at most this many GB (10^9 bytes), as transformers does.
    #[arg(long, default_value_t = 5.0)]
    pub max_shard_size_gb: f64,
    /// HF architecture the files describe: llama, mistral (sliding window) or qwen2 (q/k/v biases).
    #[arg(long, value_enum, default_value = "llama")]
    pub arch: gen::GenArch,
    /// Attention window in tokens (mistral; qwen2 with use_sliding_window).
    #[arg(long)]
    pub sliding_window: Option<usize>,
    /// Tie the output head to the token embedding (no lm_head.weight), as small Qwen2 models do.
    #[arg(long)]
    pub tie_word_embeddings: bool,
}

impl GenModelArgs {
    fn run(self) -> anyhow::Result<()> {
        let preset = gen::preset(&self.preset)
            .with_context(|| format!("unknown preset `{}`", self.preset))?;
        anyhow::ensure!(
            self.max_shard_size_gb > 0.0,
            "--max-shard-size-gb must be positive, got {}",
            self.max_shard_size_gb
        );
        let opts = gen::GenModelOptions {
            seed: self.seed,
            dtype: self.dtype,
            max_shard_bytes: (self.max_shard_size_gb * 1e9) as u64,
            arch: gen::ArchOptions {
                arch: self.arch,
                sliding_window: self.sliding_window,
                tie_word_embeddings: self.tie_word_embeddings,
            },
        };
        let start = Instant::now();
        gen::write_model(&preset, &self.out, &opts)?;
        println!(
            "wrote model `{}` to {} in {:.2?}",
            preset.name,
            self.out.display(),
            start.elapsed()
        );
        Ok(())
    }
}

#[derive(Debug, Args)]
pub struct GenAdaptersArgs {
    /// Base model directory (reads its config.json for the layer shapes and dtype).
    #[arg(long)]
    pub model: PathBuf,
    /// Number of adapters to write.
    #[arg(long, default_value_t = 8)]
    pub count: usize,
    /// Comma-separated LoRA ranks, assigned to adapters round-robin.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 16, 32, 64, 128])]
    pub ranks: Vec<usize>,
    /// Comma-separated target projections (q, k, v, o, gate, up, down; `q_proj` etc. also accepted).
    #[arg(long, value_delimiter = ',', default_values = ["q", "k", "v", "o", "gate", "up", "down"])]
    pub targets: Vec<Projection>,
    /// Output directory; adapters go to OUT/adapter-NNN-rR.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of all adapter weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// lora_alpha = alpha_ratio × r.
    #[arg(long, default_value_t = 2.0)]
    pub alpha_ratio: f64,
    /// Adapter weight dtype [default: the base model's torch_dtype].
    #[arg(long)]
    pub dtype: Option<WeightDtype>,
    /// Use rank-stabilised LoRA (scale lora_alpha/√r instead of lora_alpha/r).
    #[arg(long)]
    pub rslora: bool,
    /// Size of each adapter's delta relative to the base projection's output (‖ΔWx‖/‖Wx‖).
    #[arg(long, default_value_t = gen::DEFAULT_DELTA_REL)]
    pub delta_rel: f32,
}

impl GenAdaptersArgs {
    fn run(self) -> anyhow::Result<()> {
        let opts = gen::GenAdaptersOptions {
            model_dir: self.model,
            out_dir: self.out,
            count: self.count,
            ranks: self.ranks,
            targets: self.targets,
            seed: self.seed,
            alpha_ratio: self.alpha_ratio,
            dtype: self.dtype,
            use_rslora: self.rslora,
            delta_rel: self.delta_rel,
        };
        let start = Instant::now();
        let dirs = gen::write_adapters(&opts)?;
        println!(
            "wrote {} adapters to {} in {:.2?}",
            dirs.len(),
            opts.out_dir.display(),
            start.elapsed()
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed_and_every_flag_has_help() {
        Cli::command().debug_assert();
        for sub in Cli::command().get_subcommands() {
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if id != "help" {
                    assert!(
                        arg.get_help().is_some(),
                        "{} --{id} has no help",
                        sub.get_name()
                    );
                }
            }
        }
    }

    #[test]
    fn parses_gen_adapters_lists() {
        let cli = Cli::try_parse_from([
            "thaw",
            "gen-adapters",
            "--model",
            "m",
            "--count",
            "3",
            "--ranks",
            "8,16",
            "--targets",
            "q,v_proj,down",
            "--out",
            "o",
            "--rslora",
        ])
        .unwrap();
        let Command::GenAdapters(args) = cli.command else {
            panic!("parsed {:?}", cli.command)
        };
        assert_eq!(args.ranks, [8, 16]);
        assert_eq!(
            args.targets,
            [Projection::Q, Projection::V, Projection::Down]
        );
        assert!(args.rslora);
    }

    #[test]
    fn rejects_unknown_preset() {
        assert!(
            Cli::try_parse_from(["thaw", "gen-model", "--preset", "huge", "--out", "x"]).is_err()
        );
        let ok = Cli::try_parse_from([
            "thaw",
            "gen-model",
            "--preset",
            "tiny",
            "--out",
            "x",
            "--dtype",
            "bf16",
        ])
        .unwrap();
        let Command::GenModel(args) = ok.command else {
            panic!("parsed {:?}", ok.command)
        };
        assert_eq!(args.dtype, Some(WeightDtype::Bf16));
    }
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// HF model directory (config.json, safetensors, tokenizer.json) [default: the demo model].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// PEFT LoRA adapter directory [default with the demo model: its first adapter].
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Run the base model only, even on the demo.
    #[arg(long)]
    pub no_adapter: bool,
    /// Prompt text (encoded with the model's tokenizer, BOS added as the tokenizer says).
    #[arg(long, default_value = "The quick brown fox")]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of this request's sampling stream.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating through end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Batched LoRA kernel: sgmv (segments) or bgmv (per-row index, padded rank).
    #[arg(long, default_value = "sgmv", value_parser = ["sgmv", "bgmv"])]
    pub lora_kernel: String,
}

impl GenerateArgs {
    fn run(self) -> anyhow::Result<()> {
        use thaw_runtime::backend::LoraKernel;
        let opts = thaw_server::generate::GenerateOptions {
            model: self.model,
            adapter: self.adapter,
            no_adapter: self.no_adapter,
            prompt: self.prompt,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            chunk: self.chunk,
            lora_kernel: if self.lora_kernel == "bgmv" {
                LoraKernel::Bgmv
            } else {
                LoraKernel::Sgmv
            },
        };
        let mut stdout = std::io::stdout();
        let r = thaw_server::generate::run(&opts, &mut stdout)?;
        println!();
        eprintln!(
            "[{} prompt tokens, {} generated, finish {:?}; prefill {:.1} ms ({:.0} tok/s), decode {:.1} tok/s, CPU backend]",
            r.prompt_tokens,
            r.tokens.len(),
            r.finish,
            r.prefill_secs * 1e3,
            r.prompt_tokens as f64 / r.prefill_secs.max(1e-9),
            (r.tokens.len().saturating_sub(1)) as f64 / r.decode_secs.max(1e-9),
        );
        Ok(())
    }
}
