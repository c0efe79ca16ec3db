//! `generate` and `chat`: streaming text generation.

use crate::{load, ModelArg};
use anyhow::{Context, Result};
use clap::Args;
use ferrolm::backend::Backend;
use ferrolm::generate::{GenStats, Session};
use ferrolm::sample::{Sampler, SamplerConfig};
use ferrolm::tokenizer::{ChatMessage, StreamDecoder};
use std::io::{BufRead, Write};

#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set with this much probability (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p × the most likely one (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty over the last 64 tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed (default: a fresh one, printed with the stats).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Context length to allocate (default: the model's, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl SamplingArgs {
    fn sampler(&self) -> Result<Sampler> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        let cfg = SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            seed,
            ..Default::default()
        };
        cfg.validate()?;
        Ok(Sampler::new(cfg))
    }
    fn ctx(&self, model_max: usize) -> usize {
        self.ctx.unwrap_or(4096).min(model_max)
    }
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The prompt text.
    #[arg(long, short)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArg,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(long, short = 'n', default_value_t = 1024)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
}

fn print_stats(st: &GenStats, seed: u64) {
    eprintln!(
        "\n[prompt {} tok ({} computed) {:.1} tok/s | decode {} tok {:.1} tok/s | seed {seed}]",
        st.prompt_tokens,
        st.prefilled,
        st.prefill_tps(),
        st.generated,
        st.decode_tps()
    );
}

/// Stream tokens as text to stdout, never splitting a UTF-8 character.
fn streamer<'a, 't: 'a>(
    dec: &'a mut StreamDecoder<'t>,
    out: &'a mut dyn Write,
) -> Box<dyn FnMut(u32) -> ferrolm::Result<bool> + 'a> {
    Box::new(move |tok| {
        let s = dec.push(tok)?;
        // A closed stdout (e.g. `| head`) stops generation quietly.
        Ok(out.write_all(s.as_bytes()).and_then(|_| out.flush()).is_ok())
    })
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    crate::with_model!(load::model(&a.model)?, l => generate_on(l, a))
}

fn generate_on<B: Backend>(l: load::Loaded<B>, a: GenerateArgs) -> Result<()> {
    let mut sampler = a.sampling.sampler()?;
    let prompt_ids = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        msgs.push(ChatMessage { role: "user".into(), content: a.prompt.clone() });
        let text = l.tokenizer.apply_chat_template(&msgs, true)?;
        l.tokenizer.encode(&text, true)?
    } else {
        // Plain prompts: user text is never parsed for special tokens; BOS as the model adds it.
        let mut ids = Vec::new();
        if l.tokenizer.add_bos_default() {
            ids.extend(l.tokenizer.bos_id());
        }
        ids.extend(l.tokenizer.encode(&a.prompt, false)?);
        ids
    };
    let mut session = Session::new(&l.model, a.sampling.ctx(l.model.cfg.max_ctx))?;
    let mut dec = StreamDecoder::new(&l.tokenizer);
    let mut stdout = std::io::stdout().lock();
    let st = session.generate(
        &prompt_ids,
        a.max_tokens,
        &mut sampler,
        l.tokenizer.stop_ids(),
        streamer(&mut dec, &mut stdout),
    )?;
    let tail = dec.finish()?;
    let _ = stdout.write_all(tail.as_bytes());
    // stdout carries only the generated text; end the line only for a human at a terminal.
    if std::io::IsTerminal::is_terminal(&stdout) {
        let _ = writeln!(stdout);
    }
    print_stats(&st, sampler.cfg.seed);
    Ok(())
}

pub fn chat(a: ChatArgs) -> Result<()> {
    crate::with_model!(load::model(&a.model)?, l => chat_on(l, a))
}

fn chat_on<B: Backend>(l: load::Loaded<B>, a: ChatArgs) -> Result<()> {
    let mut sampler = a.sampling.sampler()?;
    if l.tokenizer.chat_template().is_none() {
        anyhow::bail!("this model has no chat template; use `ferrolm generate` instead");
    }
    let mut session = Session::new(&l.model, a.sampling.ctx(l.model.cfg.max_ctx))?;
    let mut msgs: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
    }
    eprintln!("ferrolm chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.");
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        line.clear();
        if stdin.lock().read_line(&mut line).context("reading stdin")? == 0 {
            break;
        }
        let text = line.trim_end_matches(['\n', '\r']);
        match text.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                msgs.truncate(usize::from(a.system.is_some()));
                continue;
            }
            _ => {}
        }
        msgs.push(ChatMessage { role: "user".into(), content: text.to_string() });
        let prompt = l.tokenizer.apply_chat_template(&msgs, true)?;
        let ids = l.tokenizer.encode(&prompt, true)?;
        let mut dec = StreamDecoder::new(&l.tokenizer);
        let mut reply_ids = Vec::new();
        let mut stdout = std::io::stdout().lock();
        let mut stream = streamer(&mut dec, &mut stdout);
        let r = session.generate(&ids, a.max_tokens, &mut sampler, l.tokenizer.stop_ids(), |t| {
            reply_ids.push(t);
            stream(t)
        });
        drop(stream);
        let st = match r {
            Ok(st) => st,
            Err(e) => {
                // e.g. the conversation outgrew the context: say so and keep the REPL alive.
                eprintln!("\nerror: {e} (use /reset to start over)");
                msgs.pop();
                continue;
            }
        };
        let _ = stdout.write_all(dec.finish()?.as_bytes());
        let _ = writeln!(stdout);
        msgs.push(ChatMessage { role: "assistant".into(), content: l.tokenizer.decode(&reply_ids)? });
        print_stats(&st, sampler.cfg.seed);
    }
    Ok(())
}
