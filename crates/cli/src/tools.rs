//! `tokenize`, `perplexity`, `inspect`, `convert`.

use crate::{load, ModelArg};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm::config::{Activation, AttnKind};
use ferrolm::formats::mlx_write::{tokenizer_files, write_mlx_dir};
use ferrolm::formats::synthetic;
use ferrolm::kv::scheme::KvScheme;
use ferrolm::quant::scheme::{self, QuantScheme};
use ferrolm::tokenizer::Tokenizer;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArg,
    /// Text to tokenize.
    #[arg(long, short, conflicts_with = "file", required_unless_present = "file")]
    text: Option<String>,
    /// File whose contents to tokenize.
    #[arg(long, short)]
    file: Option<PathBuf>,
    /// Parse special-token text (e.g. <|im_start|>) as special tokens and add BOS where the
    /// model adds one. Default: plain text, nothing added.
    #[arg(long)]
    special: bool,
}

fn read_text(text: Option<String>, file: Option<PathBuf>) -> Result<String> {
    match (text, file) {
        (Some(t), _) => Ok(t),
        (None, Some(f)) => Ok(ferrolm::files::read_text(&f)?),
        (None, None) => bail!("give --text or --file"),
    }
}

/// Tokenizers load from the model's metadata only; the weights are not touched.
fn tokenizer_only(model: Option<&str>) -> Result<Tokenizer> {
    let path = crate::hub::resolve(model)?;
    let src = if path.is_dir() {
        ferrolm::formats::TokenizerSource::Dir(path)
    } else {
        ferrolm::formats::TokenizerSource::Gguf(path)
    };
    Ok(Tokenizer::load(&src)?)
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = tokenizer_only(a.model.model.as_deref())?;
    let text = read_text(a.text, a.file)?;
    let ids = tok.encode(&text, a.special)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

/// The text a teacher-forced evaluation runs over (perplexity, kl).
#[derive(Args, Debug)]
pub struct EvalText {
    /// Text file to evaluate.
    #[arg(long, short)]
    file: PathBuf,
    /// Tokens per chunk; each chunk is evaluated from an empty cache.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// The model's KV cache scheme: bf16, affine:8, affine:4, affine:FILE.json or
    /// turbo[:kKvV] (docs/kv.md; CPU and CUDA). kl takes a
    /// comma-separated list: each scheme compared with the base, which runs once.
    #[arg(long, value_name = "SCHEME", default_value = "bf16")]
    kv: String,
    /// Keep each chunk's first N positions unquantized (bf16) in a quantized cache, in
    /// whole blocks of 32 (rounded up).
    #[arg(long, value_name = "N", default_value_t = 0)]
    kv_start: usize,
}

/// The file's token ids as an evaluation reads them: BOS first where the model adds one.
fn eval_ids(t: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids: Vec<u32> = if t.add_bos_default() { t.bos_id().into_iter().collect() } else { vec![] };
    ids.extend(t.encode(text, false)?);
    Ok(ids)
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    text: EvalText,
    /// Print {"tokens","ppl","targets","nll","argmax"} as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let text = read_text(None, Some(a.text.file.clone()))?;
    if a.text.kv_start > 0 && KvScheme::parse(&a.text.kv)? == KvScheme::Bf16 {
        bail!("--kv-start {} keeps positions unquantized in a quantized cache: give --kv too", a.text.kv_start);
    }
    let mut model = load::model(&a.model)?;
    model.set_kv_start(a.text.kv_start)?;
    crate::with_model!(model, l => perplexity_on(l, a, text))
}

fn perplexity_on<B: ferrolm::backend::Backend>(l: load::Loaded<B>, a: PerplexityArgs, text: String) -> Result<()> {
    let ids = eval_ids(&l.tokenizer, &text)?;
    let t = std::time::Instant::now();
    let kv = KvScheme::parse(&a.text.kv)?;
    let p = ferrolm::generate::perplexity(&l.model, &ids, a.text.ctx, &kv, load::progress())?;
    if a.json {
        println!("{}", serde_json::to_string(&p)?);
    } else {
        let secs = t.elapsed().as_secs_f64();
        println!(
            "tokens {}  predicted {}  ppl {:.4}  ({:.1} tok/s)",
            p.tokens,
            p.nll.len(),
            p.ppl,
            p.tokens as f64 / secs
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct KlArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The reference the model is compared with (KL(base || model)): another quantization
    /// of the same model, run on the same device. Default: the model itself (with --kv, its
    /// cache against the --base one).
    #[arg(long, value_name = "M")]
    base_model: Option<String>,
    /// The base's KV cache scheme.
    #[arg(long, value_name = "SCHEME", default_value = "bf16")]
    base: String,
    /// Quantize the base model's dense weights on load, as --quantize does for the model.
    #[arg(long, value_name = "SCHEME")]
    base_quantize: Option<String>,
    #[command(flatten)]
    text: EvalText,
    /// One JSON object instead of the summary.
    #[arg(long)]
    json: bool,
}

pub fn kl(a: KlArgs) -> Result<()> {
    let text = read_text(None, Some(a.text.file.clone()))?;
    let kvs = a.text.kv.split(',').map(KvScheme::parse).collect::<ferrolm::Result<Vec<_>>>()?;
    let schemes = (KvScheme::parse(&a.base)?, kvs);
    let mut model = load::model(&a.model)?;
    model.set_kv_start(a.text.kv_start)?;
    let Some(base_model) = &a.base_model else {
        if a.base_quantize.is_some() || schemes.1.contains(&schemes.0) {
            bail!("kl compares two things: give --base-model, or --kv (and --base) with different schemes");
        }
        return crate::with_model!(model, m => kl_on(&m, &m, &a, &schemes, &text));
    };
    let base_arg = ModelArg {
        model: Some(base_model.clone()),
        quantize: a.base_quantize.clone(),
        device: a.model.device.clone(),
        tensor_parallel: a.model.tensor_parallel,
    };
    let mut base = load::model(&base_arg).context("loading the base model")?;
    base.set_kv_start(a.text.kv_start)?;
    crate::with_model!(base, b => crate::with_model!(model, m => kl_on(&b, &m, &a, &schemes, &text)))
}

fn kl_on<A: ferrolm::backend::Backend, B: ferrolm::backend::Backend>(
    base: &load::Loaded<A>,
    l: &load::Loaded<B>,
    a: &KlArgs,
    (base_kv, kvs): &(KvScheme, Vec<KvScheme>),
    text: &str,
) -> Result<()> {
    let ids = eval_ids(&l.tokenizer, text)?;
    if eval_ids(&base.tokenizer, text)? != ids {
        bail!("the base model's tokenizer gives other tokens for the text: KL needs the same tokens");
    }
    let models: Vec<_> = kvs.iter().map(|kv| (&l.model, kv.clone())).collect();
    let rs = ferrolm::eval::kl_divergence((&base.model, base_kv), &models, &ids, a.text.ctx, load::progress())?;
    match (a.json, &rs[..]) {
        (true, [r]) => println!("{}", serde_json::to_string(r)?),
        (true, _) => println!("{}", serde_json::to_string(&rs)?),
        (false, _) => {
            for r in &rs {
                let name = if rs.len() > 1 { format!("{}: ", r.scheme) } else { String::new() };
                println!(
                    "{name}positions {}  KL mean {:.6}  median {:.6}  p90 {:.6}  p99 {:.6}  p99.9 {:.6}  max {:.6}",
                    r.positions, r.kl_mean, r.kl_median, r.kl_p90, r.kl_p99, r.kl_p999, r.kl_max
                );
                println!(
                    "{name}same top token {:.2}%  ppl base {:.4}  ppl {:.4}  ({:+.3}%)",
                    100.0 * r.top1_agreement,
                    r.ppl_base,
                    r.ppl,
                    100.0 * (r.ppl / r.ppl_base - 1.0)
                );
            }
        }
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A .gguf file, an MLX or HF directory, or a Hugging Face repo id (default: SmolLM2).
    model: Option<String>,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// The KV cache scheme to size: what one cached position (every layer and KV head)
    /// takes in bf16, affine:8, affine:4, affine:FILE.json or turbo[:kKvV].
    #[arg(long, value_name = "SCHEME", default_value = "bf16")]
    kv: String,
}

/// Sort key for tensor names in natural order: `layers.2` before `layers.10`.
fn natural_key(name: &str) -> Vec<(String, u64)> {
    let mut key = Vec::new();
    let mut rest = name;
    while !rest.is_empty() {
        let text_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let (text, tail) = rest.split_at(text_len);
        let num_len = tail.find(|c: char| !c.is_ascii_digit()).unwrap_or(tail.len());
        let (num, after) = tail.split_at(num_len);
        key.push((text.to_string(), num.parse().unwrap_or(u64::MAX)));
        rest = after;
    }
    key
}

/// `inspect --json`: the model, its config, every tensor and the tokenizer's facts.
fn inspect_json(
    src: &ferrolm::formats::ModelSource,
    tok: &ferrolm::tokenizer::Tokenizer,
    names: &[&String],
    kv: &KvScheme,
) -> Result<()> {
    let c = &src.config;
    let tensors: Vec<serde_json::Value> = names
        .iter()
        .map(|n| {
            let w = &src.tensors[*n];
            serde_json::json!({"name": n, "shape": [w.rows(), w.cols()], "format": w.describe(), "bytes": w.byte_size()})
        })
        .collect();
    let j = serde_json::json!({
        "model": src.path.display().to_string(),
        "format": src.format,
        "synthetic": src.synthetic,
        "config": {
            "arch": format!("{:?}", c.arch), "hidden": c.hidden, "layers": c.n_layers, "heads": c.n_heads,
            "kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "ffn": c.ffn, "vocab": c.vocab, "ctx": c.max_ctx,
            "rms_eps": c.rms_eps, "rope_theta": c.rope_theta, "rope_style": format!("{:?}", c.rope_style),
            "rope_linear": c.rope_linear, "llama3_scaling": c.llama3_scaling.is_some(),
            "tied_embeddings": c.tie_embeddings, "qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm,
            "post_norms": c.post_norms, "activation": activation(c.activation), "embed_scale": c.embed_scale,
            "attn_scale": c.attn_scale(), "sliding_window": c.sliding_window,
            "rope_local_theta": c.rope_local_theta,
            "layer_attention": (0..c.n_layers).map(|i| c.layer_kind(i).name()).collect::<Vec<_>>(),
        },
        "tensors": tensors,
        "bytes_in_memory": names.iter().map(|n| src.tensors[*n].byte_size()).sum::<usize>(),
        "bytes_on_disk": src.file_bytes,
        "kv": {
            "scheme": kv.to_string(), "bytes_per_position": kv.position_bytes(c),
            "bf16_bytes_per_position": KvScheme::Bf16.position_bytes(c),
        },
        "tokenizer": {
            "vocab": tok.vocab_size(), "bos": tok.bos_token(), "add_bos": tok.add_bos_default(),
            "stop_ids": tok.stop_ids(), "chat_template": tok.chat_template().is_some(),
        },
    });
    println!("{}", serde_json::to_string_pretty(&j)?);
    Ok(())
}

fn activation(a: Activation) -> &'static str {
    match a {
        Activation::Silu => "SwiGLU",
        Activation::GeluTanh => "GeGLU (tanh gelu)",
    }
}

/// Each layer's attention kind, as runs: "layers 0-4 sliding (window 512, RoPE base 10000),
/// 5 full, ...".
fn layer_attention(c: &ferrolm::config::ModelConfig) -> String {
    let mut runs: Vec<(usize, usize, AttnKind)> = Vec::new();
    for i in 0..c.n_layers {
        match runs.last_mut() {
            Some((_, end, k)) if *k == c.layer_kind(i) => *end = i,
            _ => runs.push((i, i, c.layer_kind(i))),
        }
    }
    let runs: Vec<String> = runs
        .into_iter()
        .map(|(a, b, k)| if a == b { format!("{a} {}", k.name()) } else { format!("{a}-{b} {}", k.name()) })
        .collect();
    let mut s = format!("layers {}", runs.join(", "));
    if c.layer_kinds.contains(&AttnKind::Sliding) {
        s += &format!("; window {}", c.sliding_window);
        if let Some(t) = c.rope_local_theta {
            s += &format!(", sliding layers' RoPE base {t}");
        }
    }
    s
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..=1023 => format!("{bytes} B"),
        1024..=1048575 => format!("{:.1} KiB", b / 1024.0),
        1048576..=1073741823 => format!("{:.1} MiB", b / 1048576.0),
        _ => format!("{:.2} GiB", b / 1073741824.0),
    }
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let kv = KvScheme::parse(&a.kv)?;
    let (src, tok) = load::source(a.model.as_deref())?;
    kv.check(&src.config)?;
    let mut names: Vec<&String> = src.tensors.keys().collect();
    names.sort_by_cached_key(|n| natural_key(n));
    if a.json {
        return inspect_json(&src, &tok, &names, &kv);
    }
    let c = &src.config;
    println!("model        {} ({})", crate::printable(&src.path.display().to_string()), src.format);
    if let Some(name) = &src.synthetic {
        let name = crate::printable(name);
        println!("             SYNTHETIC weights ({name}): random, not a trained model; say so with any number measured on it");
    }
    println!(
        "architecture {:?}  rope {:?} theta {}  llama3-scaling {}",
        c.arch,
        c.rope_style,
        c.rope_theta,
        c.llama3_scaling.is_some()
    );
    println!(
        "shape        hidden {}  layers {}  heads {}/{} (kv)  head_dim {}  ffn {}  vocab {}  ctx {}",
        c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab, c.max_ctx
    );
    println!("             rms_eps {}  tied embeddings {}  qkv bias {}", c.rms_eps, c.tie_embeddings, c.qkv_bias);
    println!(
        "blocks       {}  q/k norms {}  post-norms {}  embedding scale {}  query scale {}",
        activation(c.activation),
        c.qk_norm,
        c.post_norms,
        c.embed_scale,
        c.attn_scale()
    );
    println!("attention    {}", layer_attention(c));
    let (kv_bytes, bf16_bytes) = (kv.position_bytes(c), KvScheme::Bf16.position_bytes(c));
    println!(
        "KV cache     {kv}: {} a cached position ({:.2}x smaller than bf16's {})",
        human(kv_bytes as u64),
        bf16_bytes as f64 / kv_bytes as f64,
        human(bf16_bytes as u64)
    );
    println!("\n{:<48} {:>14} {:>14} {:>10}", "tensor", "shape", "format", "bytes");
    let mut total = 0u64;
    let mut by_format = std::collections::BTreeMap::<String, (usize, u64)>::new();
    for name in names {
        let w = &src.tensors[name];
        let bytes = w.byte_size() as u64;
        total += bytes;
        let e = by_format.entry(w.describe()).or_default();
        e.0 += 1;
        e.1 += bytes;
        println!(
            "{:<48} {:>14} {:>14} {:>10}",
            crate::printable(name),
            format!("[{}, {}]", w.rows(), w.cols()),
            w.describe(),
            human(bytes)
        );
    }
    println!("\nformats:");
    for (f, (n, b)) in by_format {
        println!("  {f:<14} {n:>4} tensors {:>10}", human(b));
    }
    println!("in memory {}  on disk {}", human(total), human(src.file_bytes));
    println!(
        "\ntokenizer    vocab {}  bos {:?}  add_bos {}  stop {:?}  chat template {}",
        tok.vocab_size(),
        tok.bos_token(),
        tok.add_bos_default(),
        tok.stop_ids(),
        if tok.chat_template().is_some() { "yes" } else { "no" }
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Source model: .gguf file, MLX or HF directory, or repo id.
    #[arg(long, short, required_unless_present = "synthetic", conflicts_with = "synthetic")]
    input: Option<String>,
    /// Instead of --input: seeded random weights in the shape of a real model (smollm2-135m,
    /// llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, minicpm5-1b, gemma-3-270m, gemma-3-1b,
    /// qwen3-0.6b) with SmolLM2's tokenizer padded to its vocabulary, to measure speed at
    /// sizes we cannot download. The text is gibberish.
    #[arg(long, value_name = "NAME")]
    synthetic: Option<String>,
    /// Seed of the --synthetic weights (default 0): the same seed gives the same bytes.
    #[arg(long)]
    seed: Option<u64>,
    /// Output directory (must not exist or be empty).
    #[arg(long, short)]
    output: PathBuf,
    /// Target weights: "bf16", "4", "8", "4:g32", "mixed:4,8". Default: keep as loaded
    /// ("4" for --synthetic).
    #[arg(long, short)]
    quantize: Option<String>,
}

pub fn convert(a: ConvertArgs) -> Result<()> {
    // Fail before minutes of loading or generating, not after.
    let empty = |d: &std::path::Path| -> Result<bool> {
        Ok(d.is_dir() && d.read_dir().with_context(|| format!("{}: cannot list", d.display()))?.next().is_none())
    };
    if a.output.exists() && !empty(&a.output)? {
        bail!("{}: already exists and is not an empty directory", a.output.display());
    }
    if a.seed.is_some() && a.synthetic.is_none() {
        bail!("--seed applies to --synthetic only");
    }
    let (src, tok) = match (&a.synthetic, &a.input) {
        (Some(name), _) => {
            let scheme = QuantScheme::parse(a.quantize.as_deref().unwrap_or("4"))?;
            let cfg = synthetic::config(name)?;
            let tok = synthetic::tokenizer(cfg.vocab)?;
            let t = std::time::Instant::now();
            let seed = a.seed.unwrap_or(0);
            let src = synthetic::build(name, &scheme, seed, load::progress())?;
            eprintln!(
                "generated SYNTHETIC {name} ({scheme}, seed {seed}): {} in {:.1} s",
                human(src.file_bytes),
                t.elapsed().as_secs_f64()
            );
            (src, tok)
        }
        (None, Some(input)) => {
            let (mut src, tok) = load::source(Some(input))?;
            if let Some(s) = &a.quantize {
                scheme::apply(&mut src, &QuantScheme::parse(s)?, load::progress())?;
            }
            (src, tok)
        }
        (None, None) => bail!("give --input or --synthetic"),
    };
    write_mlx_dir(&src, &a.output, &tokenizer_files(&tok)?, load::progress())?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// GPU architecture to compile for, e.g. sm_90 (default: that of CUDA device 0). Needs
    /// only the NVRTC library, not a GPU, when given.
    #[arg(long)]
    arch: Option<String>,
    /// Then remove that architecture's cached kernels that no current variant uses (left by
    /// older kernel sources).
    #[arg(long)]
    prune: bool,
}

/// Compile every CUDA kernel variant into the cache ($FERROLM_HOME/kernels) on all cores, so
/// a later start compiles nothing (e.g. before serving, or at the start of a GPU test run).
pub fn kernels(a: KernelsArgs) -> Result<()> {
    use ferrolm::backend::cuda::{nvrtc, Cuda};
    let arch = match a.arch {
        Some(arch) if arch.starts_with("sm_") && arch[3..].parse::<u32>().is_ok() => arch,
        Some(arch) => bail!("--arch {arch}: expected sm_<major><minor>, e.g. sm_90"),
        None => Cuda::new(0).context("no --arch given and no usable CUDA device")?.arch.clone(),
    };
    let t = std::time::Instant::now();
    let (compiled, cached) = nvrtc::warm_cache(&arch)?;
    eprintln!(
        "{arch}: {compiled} kernel variants compiled, {cached} already cached, in {:.1} s ({})",
        t.elapsed().as_secs_f64(),
        nvrtc::cache_dir().display()
    );
    if a.prune {
        eprintln!("{arch}: {} stale cached kernels removed", nvrtc::prune_cache(&arch)?);
    }
    Ok(())
}
