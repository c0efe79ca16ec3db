//! ferrolm's lab: probes of the device (grid and cluster barriers, a weight stream through
//! a shared-memory ring, the PDL release) and timings of the CUDA backend's ops, built on
//! the launch API the engine exposes behind its `lab` feature. Not the product: nothing
//! here is linked into `ferrolm`, and what it measures is recorded in docs/perf-log.md.
//! The binaries: `probes` (src/bin/probes.rs) and `timings` (src/bin/timings.rs).

pub mod kernels;
pub mod probe;
pub mod timing;

use cudarc::driver::{sys, CudaFunction, DriverError, LaunchConfig};
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
        // The engine's context launches with PDL where the device has clusters (sm_90+,
        // the same test) and its configuration asks for it.
        let pdl = cuda.clusters && cuda.config().pdl;
        Ok(Lab { cuda, smem_optin, pdl })
    }

    /// How many clusters of `cluster` blocks of `f` (launched as `c`, with the attributes
    /// an `Order::OverlapClustered(cluster)` launch sets; the dynamic shared memory
    /// attribute already set) the device runs at once. Not every GPC holds a whole number
    /// of clusters: on the H200, 15 clusters of 8 fit, not 16.
    pub fn max_active_clusters(&self, f: &CudaFunction, c: LaunchConfig, cluster: u32) -> Result<usize> {
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if self.pdl {
            // SAFETY: plain-old-data union; only the PDL member is set.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(a);
        }
        // SAFETY: plain-old-data union; only the cluster dimension member is set.
        let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim = match c.grid_dim.2 > 1 {
            true => sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z: cluster },
            false => sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 },
        };
        attrs.push(a);
        let config = sys::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        let mut n: std::ffi::c_int = 0;
        self.ctx.bind_to_thread().map_err(drv("cluster occupancy"))?;
        // SAFETY: config and attrs are live for the call; n is written by the driver.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
        r.result().map_err(drv("cluster occupancy"))?;
        Ok(n.max(0) as usize)
    }
}
