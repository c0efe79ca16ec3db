//! The lab's batched decode GEMV (kernels/bgemv.cuh appended to the engine's gemv.cu): one
//! launch over `m` tokens, each token's output the product GEMV's bits for it alone, for
//! `timings bgemv`.

use crate::kernels;
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::LaunchConfig;
use ferrolm::backend::cuda::{ActBuf, Cuda, CudaAct, CudaMat, KArg, Order};
use ferrolm::{Error, Result};

/// The GEMV's warps per block (gemv.cu's NW, the engine's default).
const WARPS: usize = 8;

/// Bytes of one token's staged x (x_staged.cuh's staged_bytes): int16 x, a f32 scale per
/// 32 values and a f32 sum per 16.
pub fn staged_bytes(cols: usize) -> usize {
    2 * cols + cols / 8 + cols / 4
}

/// out = x·wᵀ over `x.rows` tokens, `nt` tokens per block (1, 2, 4 or 8) staged side by
/// side in shared memory: x bf16 `[m, cols]`, w affine `[rows, cols]`, out f32 `[m, rows]`.
/// `smem_optin`: the shared memory one block may opt in to (`Lab::smem_optin`).
pub fn bgemv(g: &Cuda, x: &CudaAct, w: &CudaMat, out: &mut CudaAct, nt: usize, smem_optin: usize) -> Result<()> {
    let CudaMat::Affine { words, scales, biases, defines, rows, cols, bits, .. } = w else {
        return Err(Error::Unsupported("bgemv takes affine weights".into()));
    };
    let (ActBuf::Bf16(xb), ActBuf::F32(o)) = (&x.buf, &out.buf) else {
        return Err(Error::Invalid("bgemv: bf16 x and f32 out".into()));
    };
    if x.cols != *cols || out.rows != x.rows || out.cols != *rows || !cols.is_multiple_of(128) {
        return Err(Error::Invalid(format!("bgemv: x [m, {cols}] (a multiple of 128) and out [m, {rows}]")));
    }
    let smem = nt * staged_bytes(*cols);
    if ![1, 2, 4, 8].contains(&nt) || smem > smem_optin {
        return Err(Error::Unsupported(format!("bgemv: {nt} tokens of {cols} inputs a block ({smem} bytes)")));
    }
    let r = g.gemv_store_rows_per_warp(*rows, *cols, *bits as usize);
    let d = [defines.clone(), vec!["XQ=1".into(), format!("BG_NT={nt}")]].concat();
    let f = g.function(kernels::bgemv(), &d, &format!("bgemv_r{r}"))?;
    f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
        .map_err(crate::drv("bgemv shared memory"))?;
    let threads = 32 * WARPS as u32;
    let groups = x.rows.div_ceil(nt);
    // One wave: the resident blocks shared among the token groups (each walks its row
    // steps from blockIdx.x by the grid's width).
    let resident = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None).unwrap_or(1).max(1) as usize;
    let steps = rows.div_ceil(WARPS * r);
    let width = (g.sms * resident / groups).clamp(1, steps);
    let args = [
        g.arg(words),
        scales.arg(g),
        biases.arg(g),
        g.arg(o),
        KArg::I32(*rows as i32),
        g.arg(xb),
        KArg::I32(*cols as i32),
        KArg::I32(x.rows as i32),
    ];
    let cfg = LaunchConfig {
        grid_dim: (width as u32, groups as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    g.launch(&f, cfg, &args, Order::Serial, "bgemv launch")
}
