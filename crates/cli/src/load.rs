//! Loading a model and its tokenizer for the commands.

use crate::hub;
use anyhow::Result;
use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::cuda::Cuda;
use ferrolm::backend::sharded::{InOrder, Nccl, Sharded};
use ferrolm::backend::Backend;
use ferrolm::formats::{self, ModelSource};
use ferrolm::model::Decoder;
use ferrolm::tokenizer::Tokenizer;
use std::io::IsTerminal;

pub struct Loaded<B: Backend> {
    pub model: Decoder<B>,
    pub tokenizer: Tokenizer,
    pub file_bytes: u64,
    /// The shape's name when the weights are synthetic (random).
    pub synthetic: Option<String>,
    /// kv::file::model_fingerprint: what a KV file must have been saved from.
    pub fingerprint: String,
}

/// Show progress bars only when stderr is a terminal.
pub fn progress() -> bool {
    std::io::stderr().is_terminal()
}

pub fn source(model: Option<&str>) -> Result<(ModelSource, Tokenizer)> {
    let path = hub::resolve(model)?;
    let (src, tok) = formats::load_with_tokenizer(&path, progress())?;
    // Give the tokenizer's and the GGUF header's freed build memory back to the OS before
    // the process settles (glibc keeps small freed chunks otherwise).
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free heap pages.
    unsafe {
        libc::malloc_trim(0);
    }
    Ok((src, tok))
}

/// A loaded model on whichever backend `--device` chose.
pub enum AnyModel {
    Cpu(Box<Loaded<Cpu>>),
    Cuda(Box<Loaded<Cuda>>),
    /// `--tensor-parallel N` on the CPU: N simulated ranks.
    CpuRanks(Box<Loaded<CpuRanks>>),
    /// `--tensor-parallel N` on CUDA: N GPUs.
    CudaRanks(Box<Loaded<CudaRanks>>),
}

/// The CPU's simulated tensor-parallel ranks.
pub type CpuRanks = Sharded<Cpu, InOrder>;
/// GPUs 0..N as tensor-parallel ranks, NCCL between them.
pub type CudaRanks = Sharded<Cuda, Nccl>;

/// `--tensor-parallel N`'s backend.
pub enum Ranks {
    Cpu(CpuRanks),
    Cuda(CudaRanks),
}

/// Run `$body` with `$l` bound to the `Loaded<B>` inside an [`AnyModel`], whatever B is.
#[macro_export]
macro_rules! with_model {
    ($m:expr, $l:ident => $body:expr) => {
        match $m {
            $crate::load::AnyModel::Cpu($l) => {
                let $l = *$l;
                $body
            }
            $crate::load::AnyModel::Cuda($l) => {
                let $l = *$l;
                $body
            }
            $crate::load::AnyModel::CpuRanks($l) => {
                let $l = *$l;
                $body
            }
            $crate::load::AnyModel::CudaRanks($l) => {
                let $l = *$l;
                $body
            }
        }
    };
}

/// `--device auto` takes the GPU when a CUDA driver and device are there, else the CPU;
/// an explicit `--device cuda` that cannot be honoured is an error, never a silent fallback.
fn device(want: &str) -> Result<Option<Cuda>> {
    match want {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(Cuda::new(0)?)),
        "auto" => Ok(if ferrolm::backend::cuda::driver_available() { Cuda::new(0).ok() } else { None }),
        other => anyhow::bail!("--device {other}: expected cpu, cuda or auto"),
    }
}

/// Which backend `--device` picks, for `serve`: its engine thread makes its own device
/// context, as a context stays on the thread that made it (this one's is dropped).
pub fn device_is_cuda(want: &str) -> Result<bool> {
    Ok(device(want)?.is_some())
}

/// The model's weights (quantized as `--quantize` asks) and its tokenizer.
pub fn prepared_source(arg: &crate::ModelArg) -> Result<(ModelSource, Tokenizer)> {
    let (mut src, tokenizer) = source(arg.model.as_deref())?;
    if let Some(s) = &arg.quantize {
        ferrolm::quant::scheme::apply(&mut src, &ferrolm::quant::scheme::QuantScheme::parse(s)?, progress())?;
    }
    Ok((src, tokenizer))
}

/// Run `$body` with `$l` bound to the `&mut Loaded<B>` inside an [`AnyModel`], whatever B is.
macro_rules! with_model_mut {
    ($m:expr, $l:ident => $body:expr) => {
        match $m {
            AnyModel::Cpu($l) => $body,
            AnyModel::Cuda($l) => $body,
            AnyModel::CpuRanks($l) => $body,
            AnyModel::CudaRanks($l) => $body,
        }
    };
}

impl AnyModel {
    /// `--kv-start`: the caches keep each sequence's first `positions` in bf16.
    pub fn set_kv_start(&mut self, positions: usize) -> Result<()> {
        with_model_mut!(self, l => l.model.set_kv_start(positions)).map_err(|e| anyhow::anyhow!("--kv-start: {e}"))
    }
}

/// The model with its caches in `--kv`'s scheme (refused here when the model or the
/// device cannot take it).
pub fn model_with_kv(arg: &crate::ModelArg, kv: &crate::KvArg) -> Result<AnyModel> {
    let scheme = kv.scheme()?;
    let mut m = model(arg)?;
    with_model_mut!(&mut m, l => l.model.set_kv_scheme(scheme)).map_err(|e| anyhow::anyhow!("--kv {}: {e}", kv.kv))?;
    m.set_kv_start(kv.kv_start)?;
    Ok(m)
}

/// `--tensor-parallel N` on `--device`'s backend: the ranks (GPUs 0..N on CUDA), or why
/// they cannot be.
pub fn ranks_backend(arg: &crate::ModelArg, cfg: &ferrolm::config::ModelConfig, cuda: bool) -> Result<Option<Ranks>> {
    let n = rank_count(arg)?;
    let named = |e: ferrolm::Error| anyhow::anyhow!("--tensor-parallel {n}: {e}");
    match (n, cuda) {
        (1, _) => Ok(None),
        (n, true) => Ok(Some(Ranks::Cuda(cuda_ranks(n, cfg).map_err(named)?))),
        (n, false) => Ok(Some(Ranks::Cpu(cpu_ranks(n, cfg).map_err(named)?))),
    }
}

/// `--tensor-parallel N`'s N, refused when no rank would hold the model.
pub fn rank_count(arg: &crate::ModelArg) -> Result<usize> {
    match arg.tensor_parallel {
        0 => anyhow::bail!("--tensor-parallel 0: a model needs at least one rank"),
        n => Ok(n),
    }
}

/// GPUs 0..n as the ranks of a model of shape `cfg`.
pub fn cuda_ranks(n: usize, cfg: &ferrolm::config::ModelConfig) -> ferrolm::Result<CudaRanks> {
    let ranks = (0..n).map(Cuda::new).collect::<ferrolm::Result<Vec<_>>>()?;
    let comm = Nccl::new(&ranks)?;
    Sharded::new(ranks, cfg, comm)
}

/// n simulated CPU ranks of a model of shape `cfg`.
pub fn cpu_ranks(n: usize, cfg: &ferrolm::config::ModelConfig) -> ferrolm::Result<CpuRanks> {
    Sharded::new((0..n).map(|_| Cpu).collect(), cfg, InOrder)
}

pub fn model(arg: &crate::ModelArg) -> Result<AnyModel> {
    let mut dev = device(&arg.device)?;
    let (mut src, tokenizer) = prepared_source(arg)?;
    let (file_bytes, synthetic) = (src.file_bytes, src.synthetic.take());
    let fingerprint = ferrolm::kv::file::model_fingerprint(&src, &tokenizer);
    // GPU 0's context (`dev`) is dropped first when ranks are asked for: rank 0 opens its own.
    let ranks = match arg.tensor_parallel {
        1 => None,
        _ => ranks_backend(arg, &src.config, dev.take().is_some())?,
    };
    match ranks {
        Some(Ranks::Cpu(b)) => {
            let model = Decoder::load(b, &mut src)?;
            return Ok(AnyModel::CpuRanks(Box::new(Loaded { model, tokenizer, file_bytes, synthetic, fingerprint })));
        }
        Some(Ranks::Cuda(b)) => {
            let model = Decoder::load(b, &mut src)?;
            return Ok(AnyModel::CudaRanks(Box::new(Loaded { model, tokenizer, file_bytes, synthetic, fingerprint })));
        }
        None => {}
    }
    Ok(match dev {
        None => {
            let model = Decoder::load(Cpu, &mut src)?;
            AnyModel::Cpu(Box::new(Loaded { model, tokenizer, file_bytes, synthetic, fingerprint }))
        }
        Some(c) => {
            let model =
                Decoder::load(c, &mut src).map_err(|e| anyhow::anyhow!("{e} (use --device cpu to run on the CPU)"))?;
            AnyModel::Cuda(Box::new(Loaded { model, tokenizer, file_bytes, synthetic, fingerprint }))
        }
    })
}
