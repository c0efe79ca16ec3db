//! The lab's batched decode GEMVs, one launch over `m` tokens with each token's output the
//! product GEMV's bits for it alone, for `timings bgemv`: on DP2A (kernels/bgemv.cuh
//! appended to the engine's gemv.cu) and on integer MMAs (kernels/bgemv_mma.cu).

use crate::kernels;
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaSlice, LaunchConfig};
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

/// `m` tokens rounded up to whole warps' token tiles (`tt` tiles of 8): bgemv_mma's rows
/// of quantized x, the padding zero.
fn padded_tokens(m: usize, tt: usize) -> usize {
    m.div_ceil(8 * tt) * 8 * tt
}

/// Scratch of `bgemv_mma`: x quantized as the GEMV stages it (kernels/bgemv_mma.cu's
/// bq_quant), for up to `mp` tokens of `cols` inputs.
pub struct QuantX {
    xb: CudaSlice<u32>,
    xd: CudaSlice<f32>,
    xsx: CudaSlice<f32>,
    mp: usize,
    cols: usize,
}

impl QuantX {
    /// Room for `m` tokens of `cols` inputs at `tt` token tiles of 8 per warp.
    pub fn new(g: &Cuda, m: usize, cols: usize, tt: usize) -> Result<QuantX> {
        let (mp, chunks) = (padded_tokens(m, tt), cols / 32);
        let alloc = |n: usize| g.stream.alloc_zeros::<f32>(n).map_err(crate::drv("bgemv_mma scratch"));
        let xb = g.stream.alloc_zeros::<u32>(mp * chunks * 16).map_err(crate::drv("bgemv_mma scratch"))?;
        Ok(QuantX { xb, xd: alloc(mp * chunks)?, xsx: alloc(mp * chunks)?, mp, cols })
    }
}

/// out = x·wᵀ in the decode GEMV's arithmetic on integer MMAs (kernels/bgemv_mma.cu):
/// bq_quant, then bgemv_mma with `tt` (1, 2 or 4) token tiles of 8 per warp. 4-bit affine
/// weights in groups of 32 or more; x bf16 `[m, cols]`, out f32 `[m, rows]`; `q` from
/// `QuantX::new(g, m, cols, tt)`.
pub fn bgemv_mma(g: &Cuda, x: &CudaAct, w: &CudaMat, out: &mut CudaAct, q: &mut QuantX, tt: usize) -> Result<()> {
    let CudaMat::Affine { words, scales, biases, defines, rows, cols, bits, group, .. } = w else {
        return Err(Error::Unsupported("bgemv_mma takes affine weights".into()));
    };
    let (ActBuf::Bf16(xb), ActBuf::F32(o)) = (&x.buf, &out.buf) else {
        return Err(Error::Invalid("bgemv_mma: bf16 x and f32 out".into()));
    };
    let m = x.rows;
    if *bits != 4 || !group.is_multiple_of(32) || ![1, 2, 4].contains(&tt) {
        return Err(Error::Unsupported(format!("bgemv_mma: {bits}-bit weights in groups of {group}, {tt} tiles")));
    }
    let (mp, chunks) = (padded_tokens(m, tt), cols / 32);
    if x.cols != *cols || out.rows != m || out.cols != *rows || q.cols != *cols || q.mp < mp {
        return Err(Error::Invalid(format!("bgemv_mma: x [m, {cols}], out [m, {rows}] and scratch for them")));
    }
    let d = [defines.clone(), vec![format!("TT={tt}")]].concat();
    let quant = g.function(kernels::bgemv_mma(), &d, "bq_quant")?;
    let args = [
        g.arg(xb),
        g.arg(&q.xb),
        g.arg(&q.xd),
        g.arg(&q.xsx),
        KArg::I32(m as i32),
        KArg::I32(mp as i32),
        KArg::I32(*cols as i32),
    ];
    let cfg = LaunchConfig {
        grid_dim: ((mp * chunks).div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    g.launch(&quant, cfg, &args, Order::Serial, "bq_quant launch")?;
    let f = g.function(kernels::bgemv_mma(), &d, "bgemv_mma")?;
    let args = [
        g.arg(words),
        scales.arg(g),
        biases.arg(g),
        g.arg(&q.xb),
        g.arg(&q.xd),
        g.arg(&q.xsx),
        g.arg(o),
        KArg::I32(*rows as i32),
        KArg::I32(*cols as i32),
        KArg::I32(m as i32),
    ];
    let grid = (rows.div_ceil(16) as u32, (mp / (8 * tt)) as u32, 1);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    g.launch(&f, cfg, &args, Order::Serial, "bgemv_mma launch")
}

#[cfg(test)]
mod tests {
    /// warp_sum's butterfly (xor 16, 8, 4, 2, 1) over 32 lane values, as every lane ends it.
    fn butterfly(v: [f32; 32]) -> [f32; 32] {
        let mut v = v;
        for o in [16, 8, 4, 2, 1] {
            let prev = v;
            for (l, x) in v.iter_mut().enumerate() {
                *x = prev[l] + prev[l ^ o];
            }
        }
        v
    }

    /// bgemv_mma.cu's order: warp w pushes the lane classes brev(8w .. 8w + 7) into a
    /// 3-level binary counter, and the 4 warps' subtotals meet as ((w0 + w1) + (w2 + w3)).
    fn bit_reversed_stack(v: [f32; 32]) -> f32 {
        let sub = |w: usize| {
            let mut lv = [0f32; 3];
            for leaf in 0..8usize {
                let mut x = v[((8 * w + leaf) as u32).reverse_bits() as usize >> 27];
                let mut k = 0;
                while k < 3 && (leaf >> k) & 1 == 1 {
                    x += lv[k]; // lv[k] + x: addition commutes bit for bit
                    k += 1;
                }
                lv[if k == 3 { 0 } else { k }] = x; // the 8th leaf: the subtotal
            }
            lv[0]
        };
        (sub(0) + sub(1)) + (sub(2) + sub(3))
    }

    /// The kernel's sum is the butterfly's, bit for bit, in every lane, over values of
    /// mixed magnitudes and signs (where a different order would round differently).
    #[test]
    fn the_bit_reversed_stack_is_the_warp_butterfly() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * 10f32.powi((state % 7) as i32 - 3)
        };
        let mut orders_differ = 0;
        for _ in 0..5000 {
            let v: [f32; 32] = std::array::from_fn(|_| next());
            let lanes = butterfly(v);
            assert!(lanes.iter().all(|x| x.to_bits() == lanes[0].to_bits()), "every lane ends with one sum");
            assert_eq!(bit_reversed_stack(v).to_bits(), lanes[0].to_bits(), "{v:?}");
            orders_differ += usize::from(v.iter().sum::<f32>().to_bits() != lanes[0].to_bits());
        }
        assert!(orders_differ > 1000, "the values make sum orders matter ({orders_differ} of 5000)");
    }
}
