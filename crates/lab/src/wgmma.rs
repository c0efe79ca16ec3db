//! The lab's quantized GEMM on warpgroup MMA (kernels/qgemm_wgmma.cu, sm_90a): its launch
//! over the engine's weights and activations, in each of its forms, for `timings wgmma`.

use crate::kernels;
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::LaunchConfig;
use ferrolm::backend::cuda::{ActBuf, Cuda, CudaAct, CudaMat, KArg, Order};
use ferrolm::{Error, Result};

/// Tokens and weight rows per block (the kernel's WG_BM, WG_BN).
const TILE: usize = 128;

/// The kernel's forms (the dense one over a dequantized copy is the product's
/// `QgemmKernel::Wgmma`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgForm {
    /// qgemm_wg: two warpgroups, each loading, dequantizing and multiplying; each step's
    /// MMAs waited for before the next step.
    Shared,
    /// qgemm_wg_if: the same with one step's MMAs in flight across the next (the ring a
    /// step shorter ahead).
    SharedInFlight,
}

impl WgForm {
    pub const ALL: [WgForm; 2] = [WgForm::Shared, WgForm::SharedInFlight];

    /// The kernel's name (bf16 out; `_f32` appended for f32).
    fn kernel(self) -> &'static str {
        match self {
            WgForm::Shared => "qgemm_wg",
            WgForm::SharedInFlight => "qgemm_wg_if",
        }
    }
}

/// The ring's stages (the kernel's STAGES) and its dynamic shared memory: a 32 KiB x and w
/// tile pair a stage, plus 1 KiB to align the tiles (the kernel's WG_SMEM).
const STAGES: usize = 4;
const SMEM: usize = STAGES * 2 * TILE * 128 + 1024;

/// out = x·wᵀ on the wgmma kernel in `form`: x bf16 `[m, cols]`, w affine `[rows, cols]`
/// with cols a multiple of 64, out bf16 or f32 `[m, rows]`.
pub fn qgemm_wg(g: &Cuda, form: WgForm, x: &CudaAct, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
    let CudaMat::Affine { words, scales, biases, defines, rows, cols, .. } = w else {
        return Err(Error::Unsupported("qgemm_wg takes affine weights".into()));
    };
    let (ActBuf::Bf16(xb), true) = (&x.buf, x.cols == *cols && out.rows == x.rows && out.cols == *rows) else {
        return Err(Error::Invalid("qgemm_wg: bf16 x [m, cols] and out [m, rows]".into()));
    };
    if !cols.is_multiple_of(64) {
        return Err(Error::Unsupported(format!("qgemm_wg: cols {cols} not a multiple of 64")));
    }
    let base = form.kernel();
    let (name, o) = match &out.buf {
        ActBuf::Bf16(o) => (base.to_string(), g.arg(o)),
        ActBuf::F32(o) => (format!("{base}_f32"), g.arg(o)),
    };
    let d = [defines.clone(), vec![format!("STAGES={STAGES}")]].concat();
    let f = g.function_for_arch(kernels::qgemm_wgmma(), &d, &name, "sm_90a")?;
    f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM as i32)
        .map_err(crate::drv("qgemm_wg shared memory"))?;
    let args = [g.arg(words), scales.arg(g), biases.arg(g), g.arg(xb), o];
    let dims = [KArg::I32(*rows as i32), KArg::I32(*cols as i32), KArg::I32(x.rows as i32)];
    let args: Vec<KArg> = args.into_iter().chain(dims).collect();
    let grid = (rows.div_ceil(TILE) as u32, x.rows.div_ceil(TILE) as u32, 1);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: SMEM as u32 };
    g.launch(&f, cfg, &args, Order::Serial, "qgemm_wg launch")
}
