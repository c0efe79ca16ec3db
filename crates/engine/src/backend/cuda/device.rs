//! The CUDA backend: a device context, its configuration, the buffers its ops keep, and the
//! decode steps' graphs. Ops live by phase in decode.rs, prefill.rs, elementwise.rs and
//! sampling.rs; ops.rs implements `Backend` with them.

use super::config::CudaConfig;
use super::context::Context;
use super::scratch::Scratch;
use super::steps::Steps;
use crate::Result;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

pub struct Cuda {
    pub(crate) ctx: Context,
    pub(crate) cfg: CudaConfig,
    pub(crate) scratch: Scratch,
    pub(crate) steps: Steps,
    /// Decode MLPs run with down's x staged, and greedy heads with the argmax fused,
    /// queued or captured so far (tests check which path ran).
    pub(crate) staged_x_launches: AtomicUsize,
    pub(crate) head_argmax_launches: AtomicUsize,
    /// Post-norm adds folded into a GEMV's input (decode.rs's decode_layers).
    pub(crate) post_norm_folds: AtomicUsize,
    /// wgmma GEMMs that read a copy dequantized ahead (gemm_wgmma.rs's `Ahead`).
    pub(crate) wgmma_ahead_hits: AtomicUsize,
}

/// The context's fields and launch API are the backend's: `cuda.stream`, `cuda.launch(..)`.
impl std::ops::Deref for Cuda {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl Cuda {
    /// Device `ordinal` with the configuration the environment asks for
    /// (`CudaConfig::from_env`; the defaults where it asks for nothing).
    pub fn new(ordinal: usize) -> Result<Cuda> {
        Cuda::with_config(ordinal, CudaConfig::from_env())
    }

    /// Device `ordinal` with `cfg`.
    pub fn with_config(ordinal: usize, cfg: CudaConfig) -> Result<Cuda> {
        Ok(Cuda {
            ctx: Context::new(ordinal, &cfg)?,
            cfg,
            scratch: Scratch::default(),
            steps: Steps::default(),
            staged_x_launches: AtomicUsize::new(0),
            head_argmax_launches: AtomicUsize::new(0),
            post_norm_folds: AtomicUsize::new(0),
            wgmma_ahead_hits: AtomicUsize::new(0),
        })
    }

    pub fn config(&self) -> &CudaConfig {
        &self.cfg
    }

    /// Decode steps captured so far (each a graph instantiated).
    pub fn captures(&self) -> usize {
        self.steps.captures()
    }

    /// Decode MLPs whose down GEMV read the x staged by the SwiGLU launch.
    pub fn staged_x_launches(&self) -> usize {
        self.staged_x_launches.load(Relaxed)
    }

    /// Greedy heads that found their argmax in the head GEMV.
    pub fn head_argmax_launches(&self) -> usize {
        self.head_argmax_launches.load(Relaxed)
    }

    /// Post-norm adds folded into the next GEMV's staging.
    pub fn post_norm_folds(&self) -> usize {
        self.post_norm_folds.load(Relaxed)
    }

    /// wgmma GEMMs so far that read weights dequantized ahead (`CudaConfig::wgmma_ahead`).
    pub fn wgmma_ahead_hits(&self) -> usize {
        self.wgmma_ahead_hits.load(Relaxed)
    }
}
