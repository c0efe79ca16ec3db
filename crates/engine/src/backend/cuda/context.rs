//! The device context: driver handles, the device's facts, the kernels loaded from the
//! NVRTC cache, and the one typed launch API every op goes through.

use super::config::CudaConfig;
use super::driver::{drv, KArg};
use super::kernels::KernelFile;
use super::nvrtc;
use super::trace::Trace;
use crate::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// How a kernel joins the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// It starts once the previous kernel has completed.
    Serial,
    /// It may start while the previous kernel runs (programmatic dependent launch, where
    /// the config allows it): the kernel calls `pdl_wait()` (common.cuh) before it touches
    /// anything an earlier kernel wrote, so its weight loads overlap the previous kernel's
    /// tail and the launch gap. Graph capture keeps these as programmatic edges.
    Overlap,
    /// `Overlap`, its blocks grouped in thread-block clusters of this many along z (or x
    /// when the grid has no z extent); that grid dimension must be a multiple (sm_90+).
    OverlapClustered(u32),
}

thread_local! {
    /// Set while this thread runs a decode step as a dry pass before its capture
    /// (`Context::dry_pass`): launches are skipped, everything else (allocations, kernel
    /// loads, uploads) happens. Per thread: another thread's launches meanwhile are its own.
    static DRY_PASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub struct Context {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Where queued reads of fed steps' tokens copy (steps.rs), beside the main stream.
    pub(crate) read_stream: Arc<CudaStream>,
    /// Where a prefill's next layer is dequantized while the current one runs (gemm_wgmma.rs,
    /// `CudaConfig::wgmma_ahead`), ordered against the main stream by explicit events.
    pub(crate) side_stream: Arc<CudaStream>,
    /// e.g. "sm_90"
    pub arch: String,
    pub device_name: String,
    /// Streaming multiprocessors (sizes persistent grids).
    pub sms: usize,
    /// Thread-block clusters can be launched (sm_90+).
    pub clusters: bool,
    /// `Order::Overlap` launches use PDL (sm_90+ and `CudaConfig::pdl`).
    pdl: bool,
    /// Loaded modules by "file|defines", functions by "file|defines|function": ops look
    /// kernels up on every launch, so the key is cheap (the source hash is only computed
    /// on a miss, for the disk cache).
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Kernels compiled in this process (the rest came from the disk cache).
    pub compiled: Mutex<usize>,
    /// Set while a decode step is being captured (steps.rs).
    pub(crate) capturing: AtomicBool,
    /// The kernel timeline (`CudaConfig::trace`) and the defines of its traced builds.
    pub(crate) trace: Option<(Trace, Vec<String>)>,
}

impl Context {
    /// Open device `ordinal`; clear errors when there is no driver, no device or an old one.
    pub fn new(ordinal: usize, cfg: &CudaConfig) -> Result<Context> {
        super::require_driver()?;
        let ctx = CudaContext::new(ordinal).map_err(drv(&format!("opening device {ordinal}")))?;
        let (major, minor) = ctx.compute_capability().map_err(drv("reading the compute capability"))?;
        if major < 8 {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} has compute capability {major}.{minor}; ferrolm's kernels need 8.0 or newer"
            )));
        }
        let device_name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("reading the multiprocessor count"))? as usize;
        // cudarc's cross-stream event tracking is not needed (the work runs on one stream;
        // the read stream only copies finished steps' tokens, ordered by explicit events),
        // and its event records would otherwise land inside captured graphs.
        // SAFETY: every operation runs on `stream`, except queued reads' copies and the
        // dequantizations ahead, which wait for events recorded on it (and it for theirs).
        unsafe { ctx.disable_event_tracking() };
        // Created streams, not the legacy default one: only these can be captured.
        let read_stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        // The weights dequantized ahead (side stream) yield every SM to a waiting block of
        // the main stream's (gemm_wgmma.rs's `PassBlocks::Short`).
        let (least, greatest) =
            cudarc::driver::result::stream::get_priority_range().map_err(drv("reading the stream priorities"))?;
        let stream = ctx.new_stream_with_priority(greatest).map_err(drv("creating a stream"))?;
        let side_stream = ctx.new_stream_with_priority(least).map_err(drv("creating a stream"))?;
        let trace = match &cfg.trace {
            Some(path) => Some((Trace::new(&stream, path)?, Trace::defines(cfg.trace_all))),
            None => None,
        };
        Ok(Context {
            ctx,
            stream,
            read_stream,
            side_stream,
            arch: format!("sm_{major}{minor}"),
            device_name,
            sms,
            clusters: major >= 9,
            pdl: major >= 9 && cfg.pdl,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            compiled: Mutex::new(0),
            capturing: AtomicBool::new(false),
            trace,
        })
    }

    /// Load `func` from `file` compiled with `defines` (memory cache, then the NVRTC disk
    /// cache, then NVRTC).
    pub fn function(&self, file: &KernelFile, defines: &[String], func: &str) -> Result<CudaFunction> {
        if !super::kernels::runs_on(file.name, &self.arch) {
            return Err(Error::Unsupported(format!("{} runs on sm_90 devices only, not {}", file.name, self.arch)));
        }
        self.function_on(file, defines, func, &super::kernels::compile_arch(file.name, &self.arch))
    }

    /// `function` compiled for `arch` rather than the device's own (crates/lab: "sm_90a" for
    /// the architecture-specific instructions, such as wgmma, that the product does not use).
    #[cfg(feature = "lab")]
    pub fn function_for_arch(
        &self,
        file: &KernelFile,
        defines: &[String],
        func: &str,
        arch: &str,
    ) -> Result<CudaFunction> {
        self.function_on(file, defines, func, arch)
    }

    fn function_on(&self, file: &KernelFile, defines: &[String], func: &str, arch: &str) -> Result<CudaFunction> {
        let traced;
        let defines = match &self.trace {
            Some((_, extra)) => {
                traced = [defines, &extra[..]].concat();
                &traced[..]
            }
            None => defines,
        };
        let module_key = format!("{}|{arch}|{}", file.name, defines.join(","));
        let fn_key = format!("{module_key}|{func}");
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(&fn_key) {
            return Ok(f.clone());
        }
        let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let module = match mods.get(&module_key) {
            Some(m) => m.clone(),
            None => {
                let src = nvrtc::source(file.name, file.src);
                let (bin, hit) = nvrtc::cached(file.name, &src, arch, defines)?;
                if !hit {
                    *self.compiled.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                }
                let m = self.ctx.load_module(Ptx::from_binary(bin)).map_err(drv(&format!("loading {}", file.name)))?;
                if let Some((t, _)) = &self.trace {
                    t.attach(&self.stream, &m, self.capturing.load(Relaxed))?;
                }
                mods.insert(module_key, m.clone());
                m
            }
        };
        let f = module.load_function(func).map_err(drv(&format!("finding {func} in {}", file.name)))?;
        self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(fn_key, f.clone());
        Ok(f)
    }

    /// Launch `f` on the stream with `args` (in the kernel's parameter order and types),
    /// joining the stream as `order` says. In a dry pass (`dry_pass`) nothing is launched.
    pub fn launch(&self, f: &CudaFunction, c: LaunchConfig, args: &[KArg], order: Order, what: &str) -> Result<()> {
        self.launch_in(&self.stream, f, c, args, order, what)
    }

    /// `launch` on `stream` (the main one, or the side stream).
    pub(crate) fn launch_in(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        c: LaunchConfig,
        args: &[KArg],
        order: Order,
        what: &str,
    ) -> Result<()> {
        if let Order::OverlapClustered(cluster) = order {
            let along = if c.grid_dim.2 > 1 { c.grid_dim.2 } else { c.grid_dim.0 };
            if !self.clusters || !along.is_multiple_of(cluster) {
                return Err(Error::Invalid(format!(
                    "{what}: clusters of {cluster} over a grid of {along} (device clusters: {})",
                    self.clusters
                )));
            }
        }
        // One 8-byte slot per argument; a 4-byte scalar sits in its slot's first bytes
        // (the driver reads as many bytes as the parameter has).
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                KArg::Ptr(p) => p,
                KArg::I32(v) => u64::from(v as u32),
                KArg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut ptrs: Vec<*mut std::ffi::c_void> =
            slots.iter_mut().map(|s| s as *mut u64 as *mut std::ffi::c_void).collect();
        if let (Some((t, _)), false) = (&self.trace, self.capturing.load(Relaxed)) {
            t.flush(&self.stream)?;
        }
        if DRY_PASS.get() {
            return Ok(());
        }
        let mut attrs = self.launch_attrs(&c, order);
        let config = self.launch_config(stream, &c, &mut attrs);
        self.ctx.bind_to_thread().map_err(drv(what))?;
        // SAFETY: the caller passes args matching the kernel's parameters (device addresses
        // of live buffers, sizes checked by the caller); slots, ptrs and attrs outlive the call.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        r.result().map_err(drv(what))
    }

    /// Run `f` as a dry pass: every launch through `launch` is skipped, the rest (buffers
    /// made on first use, kernel loads) happens. What a decode step needs before its
    /// capture: an allocation captured into a graph would forbid its relaunch, and a
    /// kernel load cannot be captured.
    pub(crate) fn dry_pass(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        // Reset however f ends (a panic unwinding through it too).
        struct Dry;
        impl Drop for Dry {
            fn drop(&mut self) {
                DRY_PASS.set(false);
            }
        }
        DRY_PASS.set(true);
        let _dry = Dry;
        f()
    }

    /// Whether this thread runs a dry pass (`dry_pass`): its launches are skipped.
    pub(crate) fn in_dry_pass(&self) -> bool {
        DRY_PASS.get()
    }

    fn launch_attrs(&self, c: &LaunchConfig, order: Order) -> Vec<sys::CUlaunchAttribute> {
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if self.pdl && order != Order::Serial {
            // SAFETY: plain-old-data union; only the PDL member is set.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(a);
        }
        if let Order::OverlapClustered(size) = order {
            // SAFETY: plain-old-data union; only the cluster dimension member is set.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            a.value.clusterDim = match c.grid_dim.2 > 1 {
                true => sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z: size },
                false => sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: size, y: 1, z: 1 },
            };
            attrs.push(a);
        }
        attrs
    }

    /// The driver's launch configuration for `c` on `stream` with `attrs` (which must
    /// outlive its use).
    fn launch_config(
        &self,
        stream: &CudaStream,
        c: &LaunchConfig,
        attrs: &mut [sys::CUlaunchAttribute],
    ) -> sys::CUlaunchConfig {
        sys::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        }
    }

    /// Whether `Order::Overlap` launches use PDL here.
    #[cfg(feature = "lab")]
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// How many clusters of `cluster` blocks of `f` (launched as `c` with
    /// `Order::OverlapClustered(cluster)`, its dynamic shared memory attribute already set)
    /// the device runs at once. Not every GPC holds a whole number of clusters: on the
    /// H200, 15 clusters of 8 fit, not 16. For crates/lab's persistent probes.
    #[cfg(feature = "lab")]
    pub fn max_active_clusters(&self, f: &CudaFunction, c: LaunchConfig, cluster: u32) -> Result<usize> {
        let mut attrs = self.launch_attrs(&c, Order::OverlapClustered(cluster));
        let config = self.launch_config(&self.stream, &c, &mut attrs);
        let mut n: std::ffi::c_int = 0;
        self.ctx.bind_to_thread().map_err(drv("cluster occupancy"))?;
        // SAFETY: config and attrs are live for the call; n is written by the driver.
        let r = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
        r.result().map_err(drv("cluster occupancy"))?;
        Ok(n.max(0) as usize)
    }

    pub fn upload<T: DeviceRepr>(&self, v: &[T], what: &str) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(drv(what))
    }

    /// `n` zeroed elements on the device.
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize, what: &str) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n).map_err(drv(what))
    }

    /// A device buffer as a kernel argument.
    pub fn arg<T>(&self, s: &CudaSlice<T>) -> KArg {
        KArg::Ptr(cudarc::driver::DevicePtr::device_ptr(s, &self.stream).0)
    }

    /// Device-to-device copy bandwidth: median of 5 copies of up to 4 GiB (a quarter of free
    /// memory on smaller GPUs), counting bytes read and written.
    pub fn measure_copy_bandwidth(&self) -> Result<f64> {
        let (free, _) = self.ctx.mem_get_info().map_err(drv("reading memory use"))?;
        let bytes = (4usize << 30).min(free / 4) & !0xffff;
        let src = self.zeros::<u8>(bytes, "allocating the copy benchmark")?;
        let mut dst = self.zeros::<u8>(bytes, "allocating the copy benchmark")?;
        let mut times = Vec::new();
        for i in 0..6 {
            let t = std::time::Instant::now();
            self.stream.memcpy_dtod(&src, &mut dst).map_err(drv("copying"))?;
            self.stream.synchronize().map_err(drv("copying"))?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64()); // the first copy warms up
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(2.0 * bytes as f64 / times[times.len() / 2])
    }
}

impl Drop for Context {
    /// Write the kernel timeline, when one was recorded (`CudaConfig::trace`).
    fn drop(&mut self) {
        if let Some((t, _)) = &self.trace {
            let r =
                self.stream.synchronize().map_err(drv("finishing the traced work")).and_then(|()| t.dump(&self.stream));
            if let Err(e) = r {
                eprintln!("ferrolm: the kernel trace was not written: {e}");
            }
        }
    }
}
