//! Driver-level vocabulary shared by every module of the backend: the error mapping and the
//! typed kernel argument.

use crate::Error;
use cudarc::driver::DriverError;

/// Maps a driver error to ferrolm's, naming what was being done (out of memory said so).
pub(crate) fn drv(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| {
        let oom = e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        Error::Invalid(if oom { format!("CUDA out of memory ({what})") } else { format!("CUDA {what}: {e}") })
    }
}

/// A kernel argument: a device address, or a scalar. Launches pass these in the kernel's
/// parameter order and types.
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}
