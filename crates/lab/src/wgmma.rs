//! The lab's quantized GEMM on warpgroup MMA (kernels/qgemm_wgmma.cu, sm_90a): its launch
//! over the engine's weights and activations, in each of its forms, for `timings wgmma`.

use crate::kernels;
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::LaunchConfig;
use ferrolm::backend::cuda::{ActBuf, Cuda, CudaAct, CudaMat, KArg, Order};
use ferrolm::{Error, Result};

/// Tokens and weight rows per block (the kernel's WG_BM, WG_BN).
const TILE: usize = 128;

/// The kernel's forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgForm {
    /// qgemm_wg: two warpgroups, each loading, dequantizing and multiplying; each step's
    /// MMAs waited for before the next step.
    Shared,
    /// qgemm_wg_if: the same with one step's MMAs in flight across the next (the ring a
    /// step shorter ahead).
    SharedInFlight,
    /// qgemm_wg_dense: the weights from a bf16 copy dequantized beforehand
    /// ([`dequant_bf16`]), both tiles by cp.async, one step's MMAs in flight, six stages.
    Dense,
}

impl WgForm {
    pub const ALL: [WgForm; 3] = [WgForm::Shared, WgForm::SharedInFlight, WgForm::Dense];

    /// Whether the form reads the dequantized bf16 copy of the weights.
    pub fn dense(self) -> bool {
        self == WgForm::Dense
    }

    /// The kernel's name (bf16 out; `_f32` appended for f32).
    fn kernel(self) -> &'static str {
        match self {
            WgForm::Shared => "qgemm_wg",
            WgForm::SharedInFlight => "qgemm_wg_if",
            WgForm::Dense => "qgemm_wg_dense",
        }
    }

    /// The ring's stages (the kernel's STAGES) and its dynamic shared memory: a 32 KiB x
    /// and w tile pair a stage, plus 1 KiB to align the tiles (the kernel's WG_SMEM).
    fn stages(self) -> usize {
        if self == WgForm::Dense {
            6
        } else {
            4
        }
    }
    fn smem(self) -> usize {
        self.stages() * 2 * TILE * 128 + 1024
    }
}

/// The affine weights `w` dequantized into `out`, a bf16 `[rows, cols]` buffer (the values
/// the shared forms' tiles hold), for the dense form.
pub fn dequant_bf16(g: &Cuda, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
    let CudaMat::Affine { words, scales, biases, defines, rows, cols, .. } = w else {
        return Err(Error::Unsupported("dequant_bf16 takes affine weights".into()));
    };
    let (ActBuf::Bf16(o), true) = (&out.buf, (out.rows, out.cols) == (*rows, *cols)) else {
        return Err(Error::Invalid("dequant_bf16: out bf16 [rows, cols]".into()));
    };
    let f = g.function_for_arch(kernels::qgemm_wgmma(), defines, "dequant_bf16", "sm_90a")?;
    let args = [g.arg(words), scales.arg(g), biases.arg(g), g.arg(o), KArg::I32(*rows as i32), KArg::I32(*cols as i32)];
    let cfg = LaunchConfig { grid_dim: (g.sms as u32 * 16, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    g.launch(&f, cfg, &args, Order::Serial, "dequant_bf16 launch")
}

/// out = x·wᵀ on the wgmma kernel in `form`: x bf16 `[m, cols]`, w affine `[rows, cols]`
/// with cols a multiple of 64 (and for the dense form `dense`, its [`dequant_bf16`]
/// copy), out bf16 or f32 `[m, rows]`.
pub fn qgemm_wg(
    g: &Cuda,
    form: WgForm,
    x: &CudaAct,
    w: &CudaMat,
    dense: Option<&CudaAct>,
    out: &mut CudaAct,
) -> Result<()> {
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
    let d = [defines.clone(), vec![format!("STAGES={}", form.stages())]].concat();
    let f = g.function_for_arch(kernels::qgemm_wgmma(), &d, &name, "sm_90a")?;
    f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, form.smem() as i32)
        .map_err(crate::drv("qgemm_wg shared memory"))?;
    let dims = [KArg::I32(*rows as i32), KArg::I32(*cols as i32), KArg::I32(x.rows as i32)];
    let args: Vec<KArg> = if form.dense() {
        let Some(CudaAct { buf: ActBuf::Bf16(wd), rows: r, cols: c }) = dense else {
            return Err(Error::Invalid("qgemm_wg: the dense form takes the bf16 copy of w".into()));
        };
        if (*r, *c) != (*rows, *cols) {
            return Err(Error::Invalid("qgemm_wg: the bf16 copy's shape is not w's".into()));
        }
        [g.arg(wd), g.arg(xb), o].into_iter().chain(dims).collect()
    } else {
        [g.arg(words), scales.arg(g), biases.arg(g), g.arg(xb), o].into_iter().chain(dims).collect()
    };
    let (row_tiles, token_tiles) = (rows.div_ceil(TILE) as u32, x.rows.div_ceil(TILE) as u32);
    let grid = if form.dense() { (token_tiles, row_tiles, 1) } else { (row_tiles, token_tiles, 1) };
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: form.smem() as u32 };
    g.launch(&f, cfg, &args, Order::Serial, "qgemm_wg launch")
}
