//! CUDA backend (in progress, issue 3): kernels as `.cu` sources compiled at run time by
//! NVRTC for the device's architecture and cached on disk. cudarc loads libcuda and
//! libnvrtc dynamically, so the binary builds and runs where no CUDA is installed.

pub mod kernels;
pub mod nvrtc;

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
