//! The CUDA device: context, stream, kernels loaded from the NVRTC cache, and the device
//! forms of weights, activations and the KV cache.

use super::kernels::{self, KernelFile};
use super::nvrtc;
use crate::quant::{AffineTensor, DenseData, DenseTensor, Scales, Weight};
use crate::{Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, PinnedHostSlice,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(crate) fn drv(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| {
        let oom = e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        Error::Invalid(if oom { format!("CUDA out of memory ({what})") } else { format!("CUDA {what}: {e}") })
    }
}

/// The split-K MLP's grid: (blocks, cluster size).
pub(crate) type SplitkGrid = (usize, usize);

pub struct Cuda {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// e.g. "sm_90"
    pub arch: String,
    pub device_name: String,
    /// Streaming multiprocessors (sizes persistent grids).
    pub sms: usize,
    /// Shared memory one block may opt in to (bytes).
    pub smem_optin: usize,
    /// Launch the decode kernels with programmatic dependent launch (sm_90+; see `launch`).
    pub pdl: bool,
    /// Thread-block clusters can be launched (sm_90+).
    pub clusters: bool,
    /// Loaded modules by "file|defines", and their functions by "file|defines|function":
    /// ops look kernels up on every launch, so the key is cheap (the source hash is only
    /// computed on a miss, for the disk cache).
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Kernels compiled in this process (the rest came from the disk cache).
    pub compiled: Mutex<usize>,
    /// RoPE inverse frequencies, uploaded once per distinct table and never freed (captured
    /// graphs point at them).
    pub(crate) rope_freqs: Mutex<Vec<(Vec<f32>, CudaSlice<f32>)>>,
    /// Argmax partials (value, index per block) and its done counter: sample.cu's argmax's
    /// and the head's fused one's (fused.rs's argmax_sink_args).
    #[allow(clippy::type_complexity)]
    pub(crate) argmax_scratch: Mutex<Option<(CudaSlice<f32>, CudaSlice<i32>, CudaSlice<i32>)>>,
    /// Top-k candidates (key, index; `TOP_K_CAP` of each) and its done counter.
    #[allow(clippy::type_complexity)]
    pub(crate) top_k_scratch: Mutex<Option<(CudaSlice<u32>, CudaSlice<i32>, CudaSlice<i32>)>>,
    /// Decode attention scratch by (heads·splits, head_dim): partial max/sum, partial
    /// outputs, and per-head done counters. Kept for the process (captured graphs use it).
    #[allow(clippy::type_complexity)]
    pub(crate) attn_scratch: Mutex<HashMap<(usize, usize), (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<i32>)>>,
    /// This forward call's token ids and start position, staged in pinned host memory and
    /// copied to the device by the call itself (so graph replays pick up new values).
    pub(crate) staged: Mutex<Option<Staged>>,
    /// Captured decode steps by session key, and how many were captured (tests check reuse).
    pub(crate) graphs: Mutex<HashMap<u64, Graph>>,
    pub(crate) captures: std::sync::atomic::AtomicUsize,
    /// Set while a decode step is being captured: host-side staging (which synchronizes)
    /// is done before the capture and must not run inside it.
    pub(crate) capturing: std::sync::atomic::AtomicBool,
    /// Set while a fed decode step (`Backend::step_fed`) is being queued or captured: its
    /// token and position are on the device already, so `begin` copies nothing.
    pub(crate) feeding: std::sync::atomic::AtomicBool,
    /// What `Backend::o_proj_mlp` runs as one launch for a decode row (ffn.rs's
    /// LayerEndFusion; `FERROLM_FFN_FUSED=1|2`).
    pub(crate) ffn_fused: std::sync::atomic::AtomicU8,
    /// Decode GEMVs fed through a shared-memory ring by bulk copies (gemv_ring.cuh) where
    /// they fit (`FERROLM_GEMV_RING=0|1`; gemv_ring.rs's `ring_plan`).
    pub(crate) gemv_ring: std::sync::atomic::AtomicBool,
    /// Every layer of a decode step in one launch (megakernel.rs; `FERROLM_MEGAKERNEL=1`).
    pub(crate) megakernel: std::sync::atomic::AtomicBool,
    /// The megakernel's parameter blocks and scratch, by model, cache and buffers.
    pub(crate) mega: Mutex<HashMap<u64, super::megakernel::MkState>>,
    /// Megakernel launches queued or captured (tests check that it ran).
    pub(crate) mega_launches: std::sync::atomic::AtomicUsize,
    /// The split-K MLP's cluster partials and per-rank counters, by (clusters, hidden); and
    /// its launches (tests check that it ran).
    #[allow(clippy::type_complexity)]
    pub(crate) splitk_scratch: Mutex<HashMap<(usize, usize), (CudaSlice<f32>, CudaSlice<i32>)>>,
    pub(crate) splitk_launches: std::sync::atomic::AtomicUsize,
    /// Down projections' scales and biases transposed to [groups][rows] for the split-K
    /// MLP, by the matrix's weight address; made on first use, kept (graphs point at them).
    pub(crate) splitk_down_t: Mutex<HashMap<u64, (DevScales, DevScales)>>,
    /// The split-K MLP's (blocks, cluster size) per (steps, hidden, bits); None: no grid.
    pub(crate) splitk_grid: Mutex<HashMap<(usize, usize, usize), Option<SplitkGrid>>>,
    /// The attention block (attn_block.rs): on or off (`FERROLM_ATTN_BLOCK`), its group
    /// partials and per-rank counters by (clusters, hidden), its launch plan per weight
    /// format and shape (None: no co-resident grid), and its launches (tests check that it ran).
    pub(crate) attn_block: std::sync::atomic::AtomicBool,
    #[allow(clippy::type_complexity)]
    pub(crate) attn_block_scratch: Mutex<HashMap<(usize, usize), (CudaSlice<f32>, CudaSlice<i32>)>>,
    pub(crate) attn_block_plans: Mutex<HashMap<Vec<String>, Option<super::attn_block::Plan>>>,
    pub(crate) attn_block_launches: std::sync::atomic::AtomicUsize,
    /// The fused layer end's block counters (zeroed, reset by each launch's last block).
    pub(crate) ffn_sync: Mutex<Option<CudaSlice<i32>>>,
    /// Whether the decode MLP's SwiGLU GEMV stages down's x (staged.rs;
    /// `FERROLM_GEMV_STAGED=0` turns it off), and the staged images by width (kept: captured
    /// graphs point at them).
    pub(crate) staged_x_on: std::sync::atomic::AtomicBool,
    pub(crate) staged_x: Mutex<HashMap<usize, Arc<super::staged::StagedX>>>,
    pub(crate) staged_x_launches: std::sync::atomic::AtomicUsize,
    /// Whether a greedy step's head GEMV finds the argmax itself (head.rs;
    /// `FERROLM_HEAD_ARGMAX=0` turns it off; its partials are `argmax_scratch`), and its
    /// launches (tests check that it ran).
    pub(crate) head_argmax_on: std::sync::atomic::AtomicBool,
    pub(crate) head_argmax_launches: std::sync::atomic::AtomicUsize,
    /// Slots for `Backend::queue_read` / `take_read`.
    pub(crate) reads: Mutex<Vec<ReadSlot>>,
    /// Where queued reads copy (waiting for their step, not holding back the steps after).
    pub(crate) read_stream: std::sync::Arc<cudarc::driver::CudaStream>,
    /// The kernel timeline asked for by `FERROLM_TRACE` (trace.rs).
    pub(crate) trace: Option<super::trace::Trace>,
}

/// A kernel argument for `Cuda::launch`: a device address, or a scalar.
#[derive(Clone, Copy)]
pub(crate) enum KArg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

thread_local! {
    /// Set while this thread runs a decode step as a dry pass before its capture
    /// (`Cuda::before_capture`): launches through `launch` are skipped, everything else
    /// (allocations, kernel loads, uploads) happens. Per thread: another thread's launches
    /// on the same device meanwhile are its own.
    static DRY_PASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Fed steps' tokens the device keeps (sample.cu's FEED_HIST): the host reads a run of
/// steps' tokens while later steps run, at most two runs (2·FEED_STEPS_MAX steps) behind.
pub(crate) const FEED_HIST: usize = 64;
const _: () = assert!(2 * crate::backend::FEED_STEPS_MAX <= FEED_HIST);

/// Where a queued read of fed steps' tokens lands: a pinned (cached: the host reads it)
/// copy of the whole token history (256 bytes: one copy, where the run's slice of it may
/// wrap; entries that later steps write meanwhile are not read), the run's first position
/// and length, the event its copy records and the event that marks its steps done on the
/// main stream.
pub(crate) struct ReadSlot {
    pub(crate) hist: PinnedHostSlice<i32>,
    pub(crate) run: (usize, usize),
    pub(crate) copied: cudarc::driver::CudaEvent,
    pub(crate) done: cudarc::driver::CudaEvent,
}

/// A captured graph, owned behind the backend's mutex.
pub struct Graph(pub CudaGraph);
// SAFETY: CUDA graph handles may be used from any thread once the context is bound (cudarc
// binds it on every call); ferrolm only touches them under `Cuda::graphs`' mutex.
unsafe impl Send for Graph {}

pub struct Staged {
    pub cap: usize,
    pub tok_host: PinnedHostSlice<i32>,
    pub tok_dev: CudaSlice<i32>,
    pub pos_host: PinnedHostSlice<i32>,
    pub pos_dev: CudaSlice<i32>,
    /// The tokens fed steps chose, at their position modulo FEED_HIST (sample.cu's argmax).
    pub hist_dev: CudaSlice<i32>,
    /// Recorded after each direct upload of the staged values; `stage` waits for it.
    pub uploaded: cudarc::driver::CudaEvent,
    /// A fed step's token and position, kept while its capture's dry pass runs (`Cuda::
    /// keep_fed_input`).
    pub fed_kept: CudaSlice<i32>,
}

/// Scales or biases on the device, in their source precision.
pub enum DevScales {
    Half(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

pub enum CudaMat {
    Affine {
        rows: usize,
        cols: usize,
        words: CudaSlice<u32>,
        scales: DevScales,
        biases: DevScales,
        /// [qmv, qmv_f32, embed, qmv8, qmv8_f32]
        f: [CudaFunction; 5],
        bits: u32,
        group: usize,
        /// The -D defines this weight's kernels are compiled with (bits, group, scale dtype).
        defines: Vec<String>,
    },
    /// bf16 weights; f = [dmv, dmv_f32, dembed]
    Dense { rows: usize, cols: usize, w: CudaSlice<u16>, f: [CudaFunction; 3] },
}

impl CudaMat {
    pub fn rows(&self) -> usize {
        match self {
            CudaMat::Affine { rows, .. } | CudaMat::Dense { rows, .. } => *rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            CudaMat::Affine { cols, .. } | CudaMat::Dense { cols, .. } => *cols,
        }
    }
}

pub enum ActBuf {
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// Activations `[rows, cols]`: bf16 (f32 for logits).
pub struct CudaAct {
    pub rows: usize,
    pub cols: usize,
    pub buf: ActBuf,
}

impl CudaAct {
    pub(crate) fn bf16(&self) -> &CudaSlice<u16> {
        match &self.buf {
            ActBuf::Bf16(b) => b,
            ActBuf::F32(_) => panic!("CUDA op given f32 activations where bf16 are required"),
        }
    }
    pub(crate) fn bf16_mut(&mut self) -> &mut CudaSlice<u16> {
        match &mut self.buf {
            ActBuf::Bf16(b) => b,
            ActBuf::F32(_) => panic!("CUDA op given f32 activations where bf16 are required"),
        }
    }
}

/// bf16 KV cache: per layer `[max_seq, n_kv·hd]` for K and for V.
pub struct CudaKv {
    pub max_seq: usize,
    pub width: usize,
    pub head_dim: usize,
    pub k: Vec<CudaSlice<u16>>,
    pub v: Vec<CudaSlice<u16>>,
}

impl Cuda {
    /// Open device `ordinal`; clear errors when there is no driver, no device or an old one.
    pub fn new(ordinal: usize) -> Result<Cuda> {
        super::require_driver()?;
        let ctx = CudaContext::new(ordinal).map_err(drv(&format!("opening device {ordinal}")))?;
        let (major, minor) = ctx.compute_capability().map_err(drv("reading the compute capability"))?;
        if major < 8 {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} has compute capability {major}.{minor}; ferrolm's kernels need 8.0 or newer"
            )));
        }
        let device_name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        // The ring-fed GEMVs and the megakernel stream weights with sm_90 bulk copies: asked
        // for on an older device, they stay off, and the user is told.
        let ring = std::env::var("FERROLM_GEMV_RING").map_or(super::fused::GEMV_RING_DEFAULT, |v| v != "0");
        let mega = super::megakernel::megakernel_default();
        if major < 9 && (ring || mega) {
            eprintln!(
                "ferrolm: FERROLM_GEMV_RING / FERROLM_MEGAKERNEL need sm_90 bulk copies; on this sm_{major}{minor} device decoding runs op by op with register-fed GEMVs"
            );
        }
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("reading the multiprocessor count"))? as usize;
        let smem_optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("reading the shared memory per block"))? as usize;
        // cudarc's cross-stream event tracking is not needed (the work runs on one stream;
        // the read stream only copies finished steps' tokens, ordered by explicit events), and
        // its event records would otherwise land inside captured graphs.
        // SAFETY: every operation runs on `stream`, except queue_read's copies, which wait for
        // an event recorded on it.
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default one: only these can be captured into graphs.
        let stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        let read_stream = ctx.new_stream().map_err(drv("creating a stream"))?;
        let trace = super::trace::Trace::from_env(&stream)?;
        Ok(Cuda {
            ctx,
            stream,
            arch: format!("sm_{major}{minor}"),
            device_name,
            sms,
            smem_optin,
            // `FERROLM_PDL=0` turns it off (for A/B measurements).
            pdl: major >= 9 && std::env::var("FERROLM_PDL").map_or(true, |v| v != "0"),
            clusters: major >= 9,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            compiled: Mutex::new(0),
            rope_freqs: Mutex::new(Vec::new()),
            attn_scratch: Mutex::new(HashMap::new()),
            argmax_scratch: Mutex::new(None),
            top_k_scratch: Mutex::new(None),
            staged: Mutex::new(None),
            graphs: Mutex::new(HashMap::new()),
            captures: std::sync::atomic::AtomicUsize::new(0),
            capturing: std::sync::atomic::AtomicBool::new(false),
            feeding: std::sync::atomic::AtomicBool::new(false),
            ffn_fused: std::sync::atomic::AtomicU8::new(match std::env::var("FERROLM_FFN_FUSED").as_deref() {
                Ok("1") => 1,
                Ok("2") => 2,
                Ok("3") => 3,
                _ => 0,
            }),
            gemv_ring: std::sync::atomic::AtomicBool::new(ring && major >= 9),
            megakernel: std::sync::atomic::AtomicBool::new(mega && major >= 9),
            mega: Mutex::new(HashMap::new()),
            mega_launches: std::sync::atomic::AtomicUsize::new(0),
            splitk_scratch: Mutex::new(HashMap::new()),
            splitk_launches: std::sync::atomic::AtomicUsize::new(0),
            splitk_down_t: Mutex::new(HashMap::new()),
            splitk_grid: Mutex::new(HashMap::new()),
            attn_block: std::sync::atomic::AtomicBool::new(super::attn_block::attention_block_default()),
            attn_block_scratch: Mutex::new(HashMap::new()),
            attn_block_plans: Mutex::new(HashMap::new()),
            attn_block_launches: std::sync::atomic::AtomicUsize::new(0),
            ffn_sync: Mutex::new(None),
            staged_x_on: std::sync::atomic::AtomicBool::new(super::staged::staged_x_default()),
            staged_x: Mutex::new(HashMap::new()),
            staged_x_launches: std::sync::atomic::AtomicUsize::new(0),
            head_argmax_on: std::sync::atomic::AtomicBool::new(super::head::head_argmax_default()),
            head_argmax_launches: std::sync::atomic::AtomicUsize::new(0),
            reads: Mutex::new(Vec::new()),
            read_stream,
            trace,
        })
    }

    /// Load `func` from `file` compiled with `defines` (NVRTC disk cache, then memory cache).
    pub fn function(&self, file: &KernelFile, defines: &[String], func: &str) -> Result<CudaFunction> {
        let traced;
        let defines = match self.trace {
            Some(_) => {
                traced = [defines, &super::trace::Trace::defines()[..]].concat();
                &traced[..]
            }
            None => defines,
        };
        let module_key = format!("{}|{}", file.name, defines.join(","));
        let fn_key = format!("{module_key}|{func}");
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(&fn_key) {
            return Ok(f.clone());
        }
        let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let module = match mods.get(&module_key) {
            Some(m) => m.clone(),
            None => {
                let src = nvrtc::source(file.name, file.src);
                let (bin, hit) = nvrtc::cached(file.name, &src, &self.arch, defines)?;
                if !hit {
                    *self.compiled.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                }
                let m = self.ctx.load_module(Ptx::from_binary(bin)).map_err(drv(&format!("loading {}", file.name)))?;
                if let Some(t) = &self.trace {
                    t.attach(&self.stream, &m, self.capturing.load(std::sync::atomic::Ordering::Relaxed))?;
                }
                mods.insert(module_key, m.clone());
                m
            }
        };
        let f = module.load_function(func).map_err(drv(&format!("finding {func} in {}", file.name)))?;
        self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(fn_key, f.clone());
        Ok(f)
    }

    /// Launch `f` with `args` (in the kernel's parameter order and types). With `self.pdl`
    /// the launch allows programmatic dependent launch: the kernel may start while the
    /// previous kernel in the stream is still running, once all of that kernel's blocks
    /// have executed `pdl_trigger()` (common.cuh). So a kernel launched this way must call
    /// `pdl_wait()` before it reads or writes anything an earlier kernel touches; what it
    /// does before (loading weights, which nothing writes) overlaps the previous kernel's
    /// tail and the launch gap. Graph capture keeps these as programmatic edges.
    pub(crate) fn launch(&self, f: &CudaFunction, c: LaunchConfig, args: &[KArg], what: &str) -> Result<()> {
        self.launch_ex(f, c, args, what, None)
    }

    /// `launch` with the blocks grouped into thread-block clusters of `cluster` blocks along
    /// z, or along x when the grid has no z extent (sm_90+, `self.clusters`): a cluster's
    /// blocks run at once and read each other's shared memory (common.cuh's cluster_sync /
    /// ld_cluster). That grid dimension must be a multiple.
    pub(crate) fn launch_clustered(
        &self,
        f: &CudaFunction,
        c: LaunchConfig,
        args: &[KArg],
        what: &str,
        cluster: u32,
    ) -> Result<()> {
        let along = if c.grid_dim.2 > 1 { c.grid_dim.2 } else { c.grid_dim.0 };
        if !self.clusters || !along.is_multiple_of(cluster) {
            return Err(Error::Invalid(format!(
                "{what}: clusters of {cluster} over a grid of {along} (device clusters: {})",
                self.clusters
            )));
        }
        self.launch_ex(f, c, args, what, Some(cluster))
    }

    fn launch_ex(
        &self,
        f: &CudaFunction,
        c: LaunchConfig,
        args: &[KArg],
        what: &str,
        cluster: Option<u32>,
    ) -> Result<()> {
        use cudarc::driver::sys;
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
        if let (Some(t), false) = (&self.trace, self.capturing.load(std::sync::atomic::Ordering::Relaxed)) {
            t.flush(&self.stream)?;
        }
        if DRY_PASS.get() {
            return Ok(()); // a dry pass (before_capture): everything but the launch
        }
        let mut attrs = self.launch_attrs(&c, cluster);
        let config = self.launch_config(&c, &mut attrs);
        self.ctx.bind_to_thread().map_err(drv(what))?;
        // SAFETY: the caller passes args matching the kernel's parameters (device addresses
        // of live buffers, sizes checked by the caller); slots, ptrs and attrs outlive the call.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        r.result().map_err(drv(what))
    }

    /// The launch attributes `launch_ex` sets: PDL where on, and the cluster shape.
    fn launch_attrs(&self, c: &LaunchConfig, cluster: Option<u32>) -> Vec<cudarc::driver::sys::CUlaunchAttribute> {
        use cudarc::driver::sys;
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if self.pdl {
            // SAFETY: plain-old-data union; only the PDL member is set.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(a);
        }
        if let Some(size) = cluster {
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

    /// The driver's launch configuration for `c` on our stream with `attrs` (which must
    /// outlive its use).
    fn launch_config(
        &self,
        c: &LaunchConfig,
        attrs: &mut [cudarc::driver::sys::CUlaunchAttribute],
    ) -> cudarc::driver::sys::CUlaunchConfig {
        cudarc::driver::sys::CUlaunchConfig {
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
        }
    }

    /// How many clusters of `cluster` blocks of `f` (launched as `c`, dynamic shared memory
    /// attribute already set) the device runs at once. Not every GPC holds a whole number
    /// of clusters: on the H200, 15 clusters of 8 fit, not 16, so a grid of 16 runs its
    /// last cluster as a second wave (the split-K MLP measured 33 µs so).
    pub(crate) fn max_active_clusters(&self, f: &CudaFunction, c: LaunchConfig, cluster: u32) -> Result<usize> {
        let mut attrs = self.launch_attrs(&c, Some(cluster));
        let config = self.launch_config(&c, &mut attrs);
        let mut n: std::ffi::c_int = 0;
        self.ctx.bind_to_thread().map_err(drv("cluster occupancy"))?;
        // SAFETY: config and attrs are live for the call; n is written by the driver.
        let r = unsafe { cudarc::driver::sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
        r.result().map_err(drv("cluster occupancy"))?;
        Ok(n.max(0) as usize)
    }

    /// Device address of `rope`'s inverse frequencies (uploaded on first use).
    pub(crate) fn rope_freqs_for(&self, rope: &crate::backend::Rope) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        let mut cache = self.rope_freqs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, d)) = cache.iter().find(|(v, _)| v == &rope.inv_freq) {
            return Ok(d.device_ptr(&self.stream).0);
        }
        let d = self.upload(&rope.inv_freq, "uploading RoPE frequencies")?;
        let p = d.device_ptr(&self.stream).0;
        cache.push((rope.inv_freq.clone(), d));
        Ok(p)
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, v: &[T], what: &str) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(drv(what))
    }

    fn scales(&self, s: &Scales) -> Result<DevScales> {
        Ok(match s {
            Scales::F16(v) => DevScales::Half(self.upload(bytemuck::cast_slice::<_, u16>(v), "uploading scales")?),
            Scales::BF16(v) => DevScales::Half(self.upload(bytemuck::cast_slice::<_, u16>(v), "uploading scales")?),
            Scales::F32(v) => DevScales::F32(self.upload(v, "uploading scales")?),
        })
    }

    pub fn matrix(&self, w: Weight) -> Result<CudaMat> {
        match w {
            Weight::Affine(a) => self.affine(&a),
            Weight::Dense(d) => self.dense(&d),
        }
    }

    fn affine(&self, a: &AffineTensor) -> Result<CudaMat> {
        // 3/5/6-bit streams cross word boundaries and have no kernels yet: they run as
        // 8-bit (exact, same scales; more bytes per weight), said once per process.
        if [3, 5, 6].contains(&a.bits) && kernels::AFFINE_GROUPS.contains(&a.group) {
            static NOTE: std::sync::Once = std::sync::Once::new();
            NOTE.call_once(|| {
                eprintln!("ferrolm: CUDA runs 3/5/6-bit weights as 8-bit (same values, more bytes per weight)")
            });
            return self.affine(&a.widen(8)?);
        }
        if !kernels::AFFINE_BITS.contains(&a.bits) || !kernels::AFFINE_GROUPS.contains(&a.group) {
            return Err(Error::Unsupported(format!(
                "{}-bit weights with group {} on CUDA (supported: 2–8 bits, groups 16–128)",
                a.bits, a.group
            )));
        }
        // 16-byte chunks of a row must hold whole values: cols·bits a multiple of 128.
        if !(a.cols * a.bits as usize).is_multiple_of(128) {
            return Err(Error::Unsupported(format!("CUDA GEMV needs cols·bits divisible by 128 (cols {})", a.cols)));
        }
        // One scale type per kernel: where scales and biases differ (legacy blocks whose
        // −k·d overflowed f16 keep f32 biases) both go up as f32, exactly.
        let (scales, biases) = if a.scales.dtype() == a.biases.dtype() {
            (a.scales.clone(), a.biases.clone())
        } else {
            (Scales::F32(a.scales.to_f32_vec()), Scales::F32(a.biases.to_f32_vec()))
        };
        let defines = kernels::affine_defines(a.bits, a.group, scales.dtype());
        let file = kernels::file("affine.cu");
        let f = [
            self.function(file, &defines, "qmv")?,
            self.function(file, &defines, "qmv_f32")?,
            self.function(file, &defines, "embed")?,
            self.function(file, &defines, "qmv8")?,
            self.function(file, &defines, "qmv8_f32")?,
        ];
        Ok(CudaMat::Affine {
            rows: a.rows,
            cols: a.cols,
            words: self.upload(&a.packed, "uploading weights")?,
            scales: self.scales(&scales)?,
            biases: self.scales(&biases)?,
            f,
            bits: a.bits,
            group: a.group,
            defines,
        })
    }

    fn dense(&self, d: &DenseTensor) -> Result<CudaMat> {
        if !d.cols.is_multiple_of(8) {
            return Err(Error::Unsupported(format!("dense CUDA GEMV needs cols divisible by 8 (cols {})", d.cols)));
        }
        let bits: Vec<u16> = match &d.data {
            DenseData::BF16(v) => bytemuck::cast_slice(v).to_vec(),
            _ => d.to_f32_vec().into_iter().map(|x| bf16::from_f32(x).to_bits()).collect(),
        };
        let file = kernels::file("dense.cu");
        let f = [
            self.function(file, &[], "dmv")?,
            self.function(file, &[], "dmv_f32")?,
            self.function(file, &[], "dembed")?,
        ];
        Ok(CudaMat::Dense { rows: d.rows, cols: d.cols, w: self.upload(&bits, "uploading weights")?, f })
    }
}

impl Cuda {
    /// bf16 activations holding `data` (rounded to bf16), for tests and tools.
    pub fn act_from(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaAct> {
        let bits: Vec<u16> = data.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        Ok(CudaAct { rows, cols, buf: ActBuf::Bf16(self.upload(&bits, "uploading activations")?) })
    }
    /// f32 activations holding `data` (the residual stream's precision).
    pub fn act_from_f32(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaAct> {
        Ok(CudaAct { rows, cols, buf: ActBuf::F32(self.upload(data, "uploading activations")?) })
    }
    /// Activations filled with NaN, so elements a kernel fails to write show up.
    pub fn act_poisoned(&self, rows: usize, cols: usize, f32_out: bool) -> Result<CudaAct> {
        let n = rows * cols;
        let buf = if f32_out {
            ActBuf::F32(self.upload(&vec![f32::NAN; n], "poisoning")?)
        } else {
            ActBuf::Bf16(self.upload(&vec![0x7fc0u16; n], "poisoning")?)
        };
        Ok(CudaAct { rows, cols, buf })
    }
}

impl Cuda {
    /// Write tokens and pos0 into the pinned staging buffers (growing them, and dropping
    /// captured graphs that point at the old ones, when a call has more tokens).
    pub(crate) fn stage(&self, tokens: &[u32], pos0: usize) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        if st.as_ref().is_none_or(|s| s.cap < tokens.len()) {
            // A queued read (a speculative step's, never taken) may still copy from the old
            // token history on the read stream: let it finish before the history is freed.
            self.read_stream.synchronize().map_err(drv("waiting for queued reads"))?;
            let cap = tokens.len().next_power_of_two().max(128);
            // SAFETY: written below before any copy reads it.
            let tok_host = unsafe { self.ctx.alloc_pinned::<i32>(cap) }.map_err(drv("allocating pinned memory"))?;
            // SAFETY: as above.
            let pos_host = unsafe { self.ctx.alloc_pinned::<i32>(1) }.map_err(drv("allocating pinned memory"))?;
            let tok_dev = self.stream.alloc_zeros::<i32>(cap).map_err(drv("allocating token ids"))?;
            let pos_dev = self.stream.alloc_zeros::<i32>(1).map_err(drv("allocating the position"))?;
            let hist_dev = self.stream.alloc_zeros::<i32>(FEED_HIST).map_err(drv("allocating the token history"))?;
            let uploaded = self.ctx.new_event(None).map_err(drv("creating an event"))?;
            let fed_kept = self.stream.alloc_zeros::<i32>(2).map_err(drv("allocating a fed step's kept input"))?;
            self.graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
            *st = Some(Staged { cap, tok_host, tok_dev, pos_host, pos_dev, hist_dev, uploaded, fed_kept });
        }
        let s = st.as_mut().expect("set above");
        // The last direct upload (not a graph's) may still be queued: it reads these
        // buffers when it runs. cudarc's own tracking of that is off (see `new`).
        s.uploaded.synchronize().map_err(drv("waiting for the last upload"))?;
        let th = s.tok_host.as_mut_slice().map_err(drv("writing token ids"))?;
        for (d, &t) in th.iter_mut().zip(tokens) {
            *d = t as i32;
        }
        s.pos_host.as_mut_slice().map_err(drv("writing the position"))?[0] = pos0 as i32;
        Ok(())
    }

    /// What a decode step `f` needs before its capture: every buffer it allocates on first
    /// use and every kernel it loads (an allocation captured into a graph and not freed
    /// there would forbid its relaunch; a kernel load cannot be captured). A dry pass does
    /// that without running the step's kernels through `launch` (the few launched otherwise
    /// run, as the full run did: the capture redoes the same work, same token, position and
    /// cache slot), so the first step's graph starts without the GPU first running the step
    /// uncaptured. `FERROLM_CUDA_WARMUP=1` runs it fully instead (for A/B runs).
    pub(crate) fn before_capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        static FULL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *FULL.get_or_init(|| std::env::var("FERROLM_CUDA_WARMUP").is_ok_and(|v| v == "1")) {
            return f();
        }
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

    /// Keep (`restore` false) or put back (true) the device's token and position of a fed
    /// step whose input only the device has (the previous fed step's argmax wrote it): its
    /// capture's dry pass runs what `launch` does not skip, which must not advance them.
    /// Queued on the stream, in order with the steps before and after.
    pub(crate) fn keep_fed_input(&self, restore: bool) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_mut().ok_or_else(|| Error::Invalid("a fed decode step without staged buffers".into()))?;
        let what = || drv("keeping a fed step's input");
        match restore {
            false => {
                self.stream.memcpy_dtod(&s.tok_dev.slice(0..1), &mut s.fed_kept.slice_mut(0..1)).map_err(what())?;
                self.stream.memcpy_dtod(&s.pos_dev.slice(0..1), &mut s.fed_kept.slice_mut(1..2)).map_err(what())
            }
            true => {
                self.stream.memcpy_dtod(&s.fed_kept.slice(0..1), &mut s.tok_dev.slice_mut(0..1)).map_err(what())?;
                self.stream.memcpy_dtod(&s.fed_kept.slice(1..2), &mut s.pos_dev.slice_mut(0..1)).map_err(what())
            }
        }
    }

    /// A switch of the decode path (the setters tests compare paths with): captured steps
    /// recorded the old one, and a session of a finished one's parts would replay them, so
    /// they go (the next step captures anew). Queued work finishes first, so no graph is
    /// destroyed while it runs; a failed wait is an earlier launch's error, which the next
    /// call on the stream reports.
    pub(crate) fn decode_path_changed(&self) {
        let _ = self.stream.synchronize();
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Decode steps captured so far (each a graph instantiated).
    pub fn captures(&self) -> usize {
        self.captures.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Capture `f`'s launches as the graph for `key`, keep it and launch it once.
    pub(crate) fn capture_and_launch(&self, key: u64, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        use std::sync::atomic::Ordering::Relaxed;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("starting capture"))?;
        self.capturing.store(true, Relaxed);
        let r = f();
        self.capturing.store(false, Relaxed);
        let g = self.stream.end_capture(CUgraphInstantiate_flags(0));
        r?;
        let g = g
            .map_err(drv("capturing the decode step"))?
            .ok_or_else(|| Error::Invalid("CUDA capture produced no graph".into()))?;
        g.launch().map_err(drv("launching the decode graph"))?;
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).insert(key, Graph(g));
        self.captures.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Enqueue the staged values' copies to the device.
    pub(crate) fn upload_staged(&self) -> Result<()> {
        let mut st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.as_mut().ok_or_else(|| Error::Invalid("CUDA forward without staged tokens".into()))?;
        self.stream.memcpy_htod(&s.tok_host, &mut s.tok_dev).map_err(drv("copying token ids"))?;
        self.stream.memcpy_htod(&s.pos_host, &mut s.pos_dev).map_err(drv("copying the position"))?;
        // Not inside a capture: the event would then mark a graph node, not this upload.
        if !self.capturing.load(std::sync::atomic::Ordering::Relaxed) {
            s.uploaded.record(&self.stream).map_err(drv("recording the upload"))?;
        }
        Ok(())
    }
}

impl Drop for Cuda {
    /// Write the kernel timeline, when one was recorded (FERROLM_TRACE).
    fn drop(&mut self) {
        if let Some(t) = &self.trace {
            let r =
                self.stream.synchronize().map_err(drv("finishing the traced work")).and_then(|()| t.dump(&self.stream));
            if let Err(e) = r {
                eprintln!("ferrolm: the kernel trace was not written: {e}");
            }
        }
    }
}
