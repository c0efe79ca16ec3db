//! `generate` and `chat`: streaming text generation.

use crate::{load, ModelArg};
use anyhow::{Context, Result};
use clap::Args;
use ferrolm::backend::Backend;
use ferrolm::generate::{GenStats, Session};
use ferrolm::sample::{Sampler, SamplerConfig};
use ferrolm::tokenizer::{ChatMessage, StreamDecoder};
use std::io::{BufRead, Read, Write};

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
    /// Random seed; -1 or absent: a fresh one, printed with the stats.
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<i64>,
    /// Context length to allocate (default: the model's, at most 4096).
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl SamplingArgs {
    fn sampler(&self) -> Result<Sampler> {
        let fresh = || {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        };
        let seed = match self.seed {
            None | Some(-1) => fresh(),
            Some(s) if s >= 0 => s as u64,
            Some(s) => anyhow::bail!("--seed {s}: give a seed of 0 or more, or -1 for a random one"),
        };
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
    fn ctx(&self, model_max: usize) -> Result<usize> {
        match self.ctx {
            None => Ok(4096.min(model_max)),
            Some(n) if n == 0 || n > model_max => {
                anyhow::bail!("--ctx {n}: the model's context is 1 to {model_max} tokens")
            }
            Some(n) => Ok(n),
        }
    }
}

/// `--prompt-cache`, for generate and chat.
#[derive(Args, Debug)]
pub struct PromptCacheArg {
    /// Start from the KV cache saved in FILE when it is there (a file of another model,
    /// KV scheme or context is refused) and save the cache there afterwards (created if
    /// missing): a later run with the same prompt prefix computes only what follows it.
    #[arg(long, value_name = "FILE")]
    prompt_cache: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    kv: crate::KvArg,
    #[command(flatten)]
    cache: PromptCacheArg,
    /// The prompt text; `-` reads it from stdin.
    #[arg(long, short, required_unless_present = "prompt_file", conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    prompt_file: Option<std::path::PathBuf>,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Parse special tokens (e.g. `<|im_start|>`) written in a raw prompt; by default the
    /// prompt is plain text.
    #[arg(long, conflicts_with = "chat")]
    special: bool,
    /// Stop when the output contains this text (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
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
    #[command(flatten)]
    kv: crate::KvArg,
    #[command(flatten)]
    cache: PromptCacheArg,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(long, short = 'n', default_value_t = 1024)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// `--prompt-cache`: start `s` from the file's cache when there is one.
fn restore_cache<B: Backend>(s: &mut Session<'_, B>, file: Option<&std::path::Path>, fingerprint: &str) -> Result<()> {
    if let Some(path) = file {
        if let Some(n) = s.restore_cache(path, fingerprint)? {
            eprintln!("[prompt cache: {n} tokens from {}]", crate::printable(&path.display().to_string()));
        }
    }
    Ok(())
}

/// `--prompt-cache`: save what `s` holds.
fn save_cache<B: Backend>(s: &Session<'_, B>, file: Option<&std::path::Path>, fingerprint: &str) -> Result<()> {
    if let Some(path) = file {
        s.save_cache(path, fingerprint).with_context(|| format!("saving --prompt-cache {}", path.display()))?;
    }
    Ok(())
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
    crate::with_model!(load::model_with_kv(&a.model, &a.kv)?, l => generate_on(l, a))
}

/// The prompt: the text given, stdin for `-`, or a file's text.
fn prompt_text(a: &GenerateArgs) -> Result<String> {
    match (&a.prompt, &a.prompt_file) {
        (Some(p), _) if p == "-" => {
            let mut t = String::new();
            std::io::stdin()
                .lock()
                .take(ferrolm::files::TEXT_LIMIT)
                .read_to_string(&mut t)
                .context("reading the prompt from stdin")?;
            Ok(t)
        }
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) => Ok(ferrolm::files::read_text(f)?),
        (None, None) => anyhow::bail!("give --prompt TEXT, --prompt - (stdin) or --prompt-file FILE"),
    }
}

fn generate_on<B: Backend>(l: load::Loaded<B>, a: GenerateArgs) -> Result<()> {
    let mut sampler = a.sampling.sampler()?;
    let prompt = prompt_text(&a)?;
    let prompt_ids = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        msgs.push(ChatMessage { role: "user".into(), content: prompt });
        let text = l.tokenizer.apply_chat_template(&msgs, true)?;
        l.tokenizer.encode_chat(&text)?
    } else if a.special {
        // As the model's own tokenizer would: special tokens parsed, BOS as it adds it.
        l.tokenizer.encode(&prompt, true)?
    } else {
        // Plain prompts: user text is never parsed for special tokens; BOS as the model adds it.
        let mut ids = Vec::new();
        if l.tokenizer.add_bos_default() {
            ids.extend(l.tokenizer.bos_id());
        }
        ids.extend(l.tokenizer.encode(&prompt, false)?);
        ids
    };
    let mut session = Session::new(&l.model, a.sampling.ctx(l.model.cfg.max_ctx)?)?;
    restore_cache(&mut session, a.cache.prompt_cache.as_deref(), &l.fingerprint)?;
    let mut dec = StreamDecoder::new(&l.tokenizer);
    let mut stdout = std::io::stdout().lock();
    let stop_ids = if a.ignore_eos { &[][..] } else { l.tokenizer.stop_ids() };
    let mut out = StopText::new(&a.stop);
    let mut stopped_by_text = false;
    let st = session.generate(&prompt_ids, a.max_tokens, &mut sampler, stop_ids, |tok| {
        let (text, hit) = out.push(&dec.push(tok)?);
        stopped_by_text |= hit;
        // A closed stdout (e.g. `| head`) stops generation quietly.
        Ok(stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush()).is_ok() && !hit)
    })?;
    if !stopped_by_text {
        let (text, _) = out.push(&dec.finish()?);
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.write_all(out.finish().as_bytes());
    }
    if !st.stopped_by_eos && !stopped_by_text && st.prompt_tokens + st.generated >= session.capacity() {
        eprintln!("\n[stopped: the context of {} tokens is full; --ctx sets it]", session.capacity());
    }
    save_cache(&session, a.cache.prompt_cache.as_deref(), &l.fingerprint)?;
    // stdout carries only the generated text; end the line only for a human at a terminal.
    if std::io::IsTerminal::is_terminal(&stdout) {
        let _ = writeln!(stdout);
    }
    print_stats(&st, sampler.cfg.seed);
    Ok(())
}

pub fn chat(a: ChatArgs) -> Result<()> {
    crate::with_model!(load::model_with_kv(&a.model, &a.kv)?, l => chat_on(l, a))
}

fn chat_on<B: Backend>(l: load::Loaded<B>, a: ChatArgs) -> Result<()> {
    let mut sampler = a.sampling.sampler()?;
    if l.tokenizer.chat_template().is_none() {
        anyhow::bail!("this model has no chat template; use `ferrolm generate` instead");
    }
    let mut session = Session::new(&l.model, a.sampling.ctx(l.model.cfg.max_ctx)?)?;
    restore_cache(&mut session, a.cache.prompt_cache.as_deref(), &l.fingerprint)?;
    let mut msgs: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
    }
    eprintln!("ferrolm chat: type a message; {CHAT_HELP}");
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
            "/help" => {
                eprintln!("{CHAT_HELP}");
                continue;
            }
            t if t.starts_with('/') && !t.contains(' ') => {
                eprintln!("unknown command {}; {CHAT_HELP}", crate::printable(t));
                continue;
            }
            _ => {}
        }
        msgs.push(ChatMessage { role: "user".into(), content: text.to_string() });
        let prompt = l.tokenizer.apply_chat_template(&msgs, true)?;
        let ids = l.tokenizer.encode_chat(&prompt)?;
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
        save_cache(&session, a.cache.prompt_cache.as_deref(), &l.fingerprint)?;
    }
    Ok(())
}

const CHAT_HELP: &str = "/reset clears the conversation, /help shows this, /exit or Ctrl-D quits.";

/// Generated text checked against `--stop` strings, which may span tokens: text that could
/// still begin a stop string is held back until it cannot, so nothing is printed twice or
/// lost, and the stop string itself is never printed.
struct StopText<'s> {
    stops: &'s [String],
    held: String,
}

impl<'s> StopText<'s> {
    fn new(stops: &'s [String]) -> Self {
        StopText { stops, held: String::new() }
    }

    /// The text that can be printed after `piece`, and whether a stop string was reached.
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first = self.stops.iter().filter(|s| !s.is_empty()).filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// What is still held back when generation ends without a stop string.
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::StopText;

    /// Stop strings split across pieces are found, text before them printed once, text
    /// that only might start one held back and released when it cannot.
    #[test]
    fn stop_strings_across_pieces() {
        let stops = vec!["</answer>".to_string(), "\n\n".to_string()];
        let mut s = StopText::new(&stops);
        assert_eq!(s.push("The answer"), ("The answer".into(), false));
        assert_eq!(s.push(" is 4</an"), (" is 4".into(), false));
        assert_eq!(s.push("swer> more"), ("".into(), true));
        let mut s = StopText::new(&stops);
        assert_eq!(s.push("a <"), ("a ".into(), false));
        assert_eq!(s.push("b> c\n"), ("<b> c".into(), false));
        assert_eq!(s.push("d"), ("\nd".into(), false));
        assert_eq!(s.push("\n"), ("".into(), false));
        assert_eq!(s.finish(), "\n");
        let none: Vec<String> = vec![];
        let mut s = StopText::new(&none);
        assert_eq!(s.push("all of it"), ("all of it".into(), false));
    }
}
