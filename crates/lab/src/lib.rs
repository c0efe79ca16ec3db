//! ferrolm's lab: probes of the device (grid and cluster barriers, a weight stream through
//! a shared-memory ring, the PDL release) and timings of the CUDA backend's ops, built on
//! the launch API the engine exposes behind its `lab` feature. Not the product: nothing
//! here is linked into `ferrolm`, and what it measures is recorded in docs/perf-log.md.
//! The binaries: `probes` (src/bin/probes.rs) and `timings` (src/bin/timings.rs).

pub mod bgemv;
pub mod kernels;
pub mod probe;
pub mod release_probe;
pub mod timing;
pub mod wgmma;

use cudarc::driver::{sys, DriverError};
use ferrolm::backend::cuda::Cuda;
use ferrolm::{Error, Result};

/// Maps a driver error to ferrolm's, naming what was being done.
pub fn drv(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| Error::Invalid(format!("CUDA {what}: {e}"))
}

/// A CUDA device as the probes see it: the engine's context (through `Deref`: `sms`,
/// `stream`, `function`, `launch`, …) and the few facts of the device the engine does not
/// keep.
pub struct Lab<'a> {
    cuda: &'a Cuda,
    /// Shared memory one block may opt in to (bytes).
    pub smem_optin: usize,
    /// `Order::Overlap` launches use PDL: sm_90+ and the engine's configuration
    /// (`CudaConfig::pdl`), as the engine's context decides it.
    pub pdl: bool,
}

impl std::ops::Deref for Lab<'_> {
    type Target = Cuda;
    fn deref(&self) -> &Cuda {
        self.cuda
    }
}

impl<'a> Lab<'a> {
    pub fn new(cuda: &'a Cuda) -> Result<Lab<'a>> {
        let smem_optin = cuda
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("reading the shared memory per block"))? as usize;
        let pdl = cuda.pdl();
        Ok(Lab { cuda, smem_optin, pdl })
    }
}
