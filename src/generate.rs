//! `kvfleet generate`: one prompt through a local engine, printed as it is generated.

use anyhow::{Context, Result};
use clap::Args;
use kvfleet_core::chat::ChatMessage;
use kvfleet_engine::{CpuBackend, Engine, EngineConfig, Request, SamplingParams};
use std::io::Write;

/// Arguments of `kvfleet generate`.
#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: crate::serve_args::ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Random seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// KV blocks in the pool.
    #[arg(long, default_value_t = 4096)]
    num_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = kvfleet_core::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
}

/// Runs the command.
pub fn run(args: GenerateArgs) -> Result<()> {
    let loaded = args.model.load()?;
    let text = if args.chat {
        loaded
            .chat_template
            .render(&[ChatMessage::user(args.prompt.clone())], &[], true)
            .context("rendering the chat template")?
    } else {
        args.prompt.clone()
    };
    // A chat template renders any BOS itself; a raw prompt gets the one the model asks for.
    let prompt = if args.chat {
        loaded.tokenizer.encode(&text)
    } else {
        loaded.tokenizer.encode_text_prompt(&text)
    }
    .context("tokenizing")?;
    let backend = CpuBackend::new(loaded.model.clone(), args.num_blocks, args.block_size);
    let mut engine = Engine::new(
        EngineConfig {
            model_id: loaded.id.clone(),
            block_size: args.block_size,
            ..EngineConfig::default()
        },
        Box::new(backend),
        Some(loaded.tokenizer.clone()),
    )?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ..SamplingParams::default()
    };
    engine.add_request(Request::new(1, prompt, params))?;
    let started = std::time::Instant::now();
    let mut first_token = None;
    let mut out = std::io::stdout().lock();
    let mut generated = 0usize;
    let mut finish = None;
    let mut prompt_tokens = 0;
    while engine.has_unfinished() {
        for o in engine.step()? {
            if o.token.is_some() {
                generated += 1;
                first_token.get_or_insert_with(|| started.elapsed());
            }
            prompt_tokens = o.prompt_tokens;
            write!(out, "{}", o.text)?;
            out.flush()?;
            if o.finish.is_some() {
                finish = o.finish;
            }
        }
    }
    writeln!(out)?;
    let total = started.elapsed();
    eprintln!(
        "[{}] prompt {} tokens, generated {} tokens, finish {:?}, first token {:.1} ms, total {:.1} ms",
        loaded.id,
        prompt_tokens,
        generated,
        finish,
        first_token.unwrap_or(total).as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3,
    );
    Ok(())
}
