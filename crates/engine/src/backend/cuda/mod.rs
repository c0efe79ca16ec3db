//! CUDA backend (issue 3, in progress): kernels as `.cu` sources compiled at run time by
//! NVRTC for the device's architecture and cached on disk; bf16 activations with f32
//! accumulation; bf16 KV cache. cudarc loads libcuda and libnvrtc dynamically, so the binary
//! builds and runs where no CUDA is installed.

// Kernel launches take long positional argument lists; a binding that shadows an unrelated
// one (a warp count by a pointer, once) passes every CPU check and fails only on a GPU.
#![deny(clippy::shadow_unrelated)]

mod attn_block;
mod attn_decode;
pub mod device;
pub mod ffn;
mod flash;
mod fused;
mod gemm;
mod gemv_ring;
mod head;
pub mod kernels;
mod megakernel;
pub mod nvrtc;
pub mod ops;
pub mod probe;
mod staged;
mod trace;

pub use device::{Cuda, CudaAct, CudaKv, CudaMat};

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
