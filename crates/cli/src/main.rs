//! The `ferrolm` command line: generate, chat, serve, tokenize, perplexity, inspect, convert,
//! bench.

mod bench;
mod chat;
mod hub;
mod load;
mod serve;
mod tools;

use clap::{Args, Parser, Subcommand};

/// Bounds the memory a chat template may take while it renders (ferrolm::alloc_guard).
#[global_allocator]
static ALLOC: ferrolm::alloc_guard::GuardedAlloc = ferrolm::alloc_guard::GuardedAlloc;

#[derive(Parser)]
#[command(
    name = "ferrolm",
    version,
    about = "Run quantized LLMs fast: GGUF, MLX and Hugging Face models on CUDA GPUs and CPUs"
)]
struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, streamed to stdout; speed goes to stderr.
    Generate(chat::GenerateArgs),
    /// Interactive multi-turn chat using the model's chat template.
    Chat(chat::ChatArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (docs/serving.md).
    Serve(serve::ServeArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(tools::TokenizeArgs),
    /// Teacher-forced perplexity over a text file.
    Perplexity(tools::PerplexityArgs),
    /// Teacher-forced KL divergence of a model from a base model over a text file.
    Kl(tools::KlArgs),
    /// Show a model's architecture, tensors, quantization and tokenizer.
    Inspect(tools::InspectArgs),
    /// Convert a model (GGUF, MLX or HF directory) to an MLX-format directory.
    Convert(tools::ConvertArgs),
    /// Measure prefill and decode speed (medians over repeated runs).
    Bench(bench::BenchArgs),
    /// Compile every CUDA kernel into the kernel cache now (so no later start compiles).
    Kernels(tools::KernelsArgs),
}

/// `--model`: shared by every command that loads a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArg {
    /// A .gguf file, an MLX or Hugging Face directory, or a Hugging Face repo id.
    /// Default: SmolLM2-135M-Instruct (fetched on first use).
    #[arg(long, short)]
    pub model: Option<String>,
    /// Quantize dense (e.g. bf16 Hugging Face) weights on load: "4", "8", "4:g32",
    /// "mixed:4,8", or "bf16". Default: weights stay as the file has them.
    #[arg(long)]
    pub quantize: Option<String>,
    /// cpu, cuda, or auto (CUDA when a GPU and driver are present, else CPU).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Split the model over N ranks (tensor parallelism: heads, FFN columns and the
    /// vocabulary; docs/tensor-parallel.md): GPUs 0..N with --device cuda (NCCL). On the
    /// CPU the ranks are simulated in one process and give exactly the unsplit model's
    /// logits (a check, not a speed-up).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tensor_parallel: usize,
}

/// `--kv`: the KV cache's scheme, for the commands that generate.
#[derive(Args, Clone, Debug)]
pub struct KvArg {
    /// How the KV cache stores keys and values: bf16, affine:8, affine:4, affine:FILE.json
    /// (bits per layer) or turbo[:k<K>v<V>] (turbo = turbo:k8v3); docs/kv.md. CPU and CUDA
    /// (head dims 64, 128 and 256 on CUDA).
    #[arg(long, default_value = "bf16")]
    pub kv: String,
    /// Keep each sequence's first N positions unquantized (bf16) in a quantized cache,
    /// in whole blocks of 32 (rounded up); docs/kv.md.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub kv_start: usize,
}

impl KvArg {
    /// The scheme, and `--kv-start` refused where it means nothing (a bf16 cache).
    pub fn scheme(&self) -> anyhow::Result<ferrolm::kv::scheme::KvScheme> {
        let scheme = ferrolm::kv::scheme::KvScheme::parse(&self.kv)?;
        if self.kv_start > 0 && scheme == ferrolm::kv::scheme::KvScheme::Bf16 {
            anyhow::bail!(
                "--kv-start {} keeps positions unquantized in a quantized cache: give --kv too",
                self.kv_start
            );
        }
        Ok(scheme)
    }
}

fn main() {
    // Die quietly on a closed pipe (`ferrolm inspect | head`), as Unix tools do, instead of
    // panicking inside println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    // Run the command on a worker of the pool: parallel regions then start from inside the
    // pool instead of waking it from outside, which costs ~10 µs per region on few cores.
    // At most the machine's cores: more only adds waiting (and `--threads 100000` would
    // spawn them all).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = match cli.threads {
        Some(n) if n > cores => {
            eprintln!("ferrolm: --threads {n} capped at this machine's {cores} cores");
            cores
        }
        t => t.unwrap_or(0),
    };
    // The server's engine runs on a thread of its own, which joins a pool the global
    // pool's size (serving/mod.rs): the global pool is sized here instead.
    let pool = match &cli.cmd {
        Cmd::Serve(_) => rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().map(|_| None),
        _ => rayon::ThreadPoolBuilder::new().num_threads(threads).build().map(Some),
    };
    let r = match pool {
        Ok(Some(pool)) => pool.install(|| run(cli.cmd)),
        Ok(None) => run(cli.cmd),
        Err(e) => {
            eprintln!("error: thread pool: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        // One line: the chain of causes, outermost first.
        let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
        eprintln!("error: {}", printable(&msg.join(": ")));
        std::process::exit(1);
    }
}

fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Generate(a) => chat::generate(a),
        Cmd::Chat(a) => chat::chat(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Tokenize(a) => tools::tokenize(a),
        Cmd::Perplexity(a) => tools::perplexity(a),
        Cmd::Kl(a) => tools::kl(a),
        Cmd::Inspect(a) => tools::inspect(a),
        Cmd::Convert(a) => tools::convert(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Kernels(a) => tools::kernels(a),
    }
}

pub use ferrolm::files::printable;
