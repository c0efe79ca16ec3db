//! CUDA backend: kernels as `.cu` sources (crates/engine/kernels/) compiled at run time by
//! NVRTC for the device's architecture and cached on disk; bf16 activations with f32
//! accumulation, an f32 residual stream, a bf16 KV cache. cudarc loads libcuda and libnvrtc
//! dynamically, so the binary builds and runs where no CUDA is installed.
//!
//! Layout, each module using only those above it:
//! - driver, config, kernels, nvrtc, trace: vocabulary, `CudaConfig`, the kernel sources
//!   and their variants, run-time compilation, the kernel timeline;
//! - context: the device, the kernel cache and the one typed launch API (`Context::launch`);
//! - tensors: weights, activations and the KV cache on the device (kv_quant: quantized
//!   stores and their kernels' launches);
//! - scratch, steps: buffers kept for captured graphs; staging, graph capture and replay;
//! - device: `Cuda`, the above put together;
//! - gemv, decode, decode_rows: the decode GEMV and the decode step (decode.rs reads top to
//!   bottom), and a generated call's rows through the same kernels, batched;
//! - prefill, gemm, gemm_wgmma, flash, elementwise, sampling: the other phases' ops;
//! - ops: `Backend for Cuda`.

// Kernel launches take long positional argument lists; a binding that shadows an unrelated
// one (a warp count by a pointer, once) passes every CPU check and fails only on a GPU.
#![deny(clippy::shadow_unrelated)]

mod config;
mod context;
mod decode;
mod decode_rows;
mod device;
mod driver;
mod elementwise;
mod flash;
mod gemm;
mod gemm_wgmma;
mod gemv;
pub mod kernels;
mod kv_quant;
pub mod nvrtc;
mod ops;
mod prefill;
mod sampling;
mod scratch;
mod steps;
mod tensors;
mod trace;

pub use config::CudaConfig;
pub use device::Cuda;
pub use gemm::{QgemmKernel, SMALL_M};
pub use gemm_wgmma::WGMMA_MIN_M;
pub use tensors::{ActBuf, CudaAct, CudaKv, CudaMat, DevScales};
/// The launch API, for crates/lab's probes (cargo feature `lab`).
#[cfg(feature = "lab")]
pub use {context::Context, context::Order, driver::KArg};

use crate::{Error, Result};

/// Is a CUDA driver loadable on this machine?
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Clear error for `--device cuda` where CUDA cannot be used.
pub fn require_driver() -> Result<()> {
    if driver_available() {
        Ok(())
    } else {
        Err(Error::Unsupported(
            "--device cuda: no CUDA driver (libcuda.so) was found on this machine; use --device cpu".into(),
        ))
    }
}
