//! Tensor-core GEMM for affine weights, the prefill path (kernels/gemm.cu).
//!
//! out[t, r] = Σ_k x[t, k]·(scale·q + bias)[r, k] for many tokens at once: each block
//! dequantizes a 64-row × 64-k weight tile to bf16 in shared memory once and multiplies it
//! with a 64-token activation tile on the tensor cores (mma.sync m16n8k16, f32 accumulation).
//! The weight precision seen by the tensor cores is bf16 (scale·q + bias rounded once), about
//! 2⁻⁹ relative per weight, well inside the 1e-2 parity tolerance.
//!
//! Up to [`SMALL_M`] tokens run on the few-token kernels (gemm_small.cuh: blocks of 8 rows,
//! K split over up to 8 warps in 256-value chunks); both kernels share qgemm.cuh's
//! arithmetic, so a row's outputs have the same bits whichever ran and however many tokens
//! the call has (the serving engine's batch invariance rests on this). The wide tiles (128
//! tokens a block, `CudaConfig::gemm_wide_tiles`) share it too.
//!
//! What it runs: affine weights of 2, 4 or 8 bits, any group the CUDA backend loads, any
//! number of rows and tokens, cols a multiple of 32 (every 2- and 4-bit tensor; 8-bit
//! tensors whose cols is an odd multiple of 16 are refused). Dense weights are refused.
//! Refusals are errors, never a silent fallback: callers check [`Cuda::qgemm_supported`]
//! first and use the GEMV otherwise (outside the serving engine's calls, also the better
//! choice below 16 tokens: prefill.rs).

use super::context::Order;
use super::device::Cuda;
use super::driver::KArg;
use super::kernels;
use super::tensors::{ActBuf, CudaAct, CudaMat};
use crate::config::Activation;
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;

/// Tokens per block (gemm.cu's BM).
const TILE_TOKENS: usize = 64;
/// Output rows per block (gemm.cu's BN).
const TILE_ROWS: usize = 64;
/// cols must be a multiple of this (one thread's 32-value weight segment).
const COLS_MULTIPLE: usize = 32;
/// Most tokens the few-token kernels take (gemm_small.cuh's _m4: four m16 tiles).
pub const SMALL_M: usize = 64;
/// Tokens of the few-token kernel's one-tile form (_m1).
const SMALL_M1: usize = 16;
/// Output rows per few-token block and its most warps (gemm_small.cuh's SMALL_ROWS,
/// SMALL_WARPS); a block has a warp per 256-value chunk of K up to that.
const SMALL_ROWS: usize = 8;
const SMALL_WARPS: usize = 8;
const CHUNK_K: usize = 256;
/// Fewer tokens than this leave half of a wide tile idle: Auto keeps the 64-token tiles.
pub const WIDE_MIN_M: usize = 128;
/// Wide tiles won on matrices of 4096 rows and more (`timings qgemm` at 512 tokens: 8B
/// shapes 12-19% faster, 1B's 8192-row gate 9%) and tied or lost on 2048 rows (1B q/o,
/// down): fewer, longer blocks do not fill the GPU there.
const WIDE_MIN_ROWS: usize = 4096;

/// Which quantized GEMM kernel runs a call. `Auto` picks by token count (and
/// `CudaConfig::gemm_wide_tiles`); naming one is for the tests and timings that hold the
/// kernels to the same bits and compare their speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QgemmKernel {
    Auto,
    /// 64×64 tiles (gemm.cu's qgemm*).
    Tiled,
    /// 128 tokens × 64 rows a block (gemm.cu's *_w128): each dequantized weight tile serves
    /// twice the tokens. Auto takes it from [`WIDE_MIN_M`] tokens and `WIDE_MIN_ROWS` rows
    /// where `CudaConfig::gemm_wide_tiles` (the default).
    Wide,
    /// Eight rows per block, K over up to 8 warps (gemm_small.cuh), up to [`SMALL_M`] tokens.
    Small,
    /// The weights dequantized into a bf16 copy, then Hopper's warpgroup MMA over 128 × 128
    /// tiles (gemm_wgmma.cu, sm_90 devices only, cols a multiple of 64). Auto takes it from
    /// [`WGMMA_MIN_M`] tokens for matrices of `CudaConfig::wgmma_min_weights` weights and
    /// more where `CudaConfig::gemm_wgmma` (the default) and no graph is being captured.
    Wgmma,
}

/// Whether the few-token kernel beats the tiled one at m tokens over `rows` rows (of each
/// matrix: gate and up for the GLU form), by a cost model fitted to `timings few` on the H200
/// (docs/perf-log.md Session 30; it picks the faster kernel in every 1B and 8B case measured
/// but the 1B down projection at 64 tokens, within 16% there). The few-token kernel costs a
/// time per weight element that grows with the tokens (each block of 8 rows reads all of x):
/// about 1.0 ps at ≤ 4 tokens, 1.6 at ≤ 16, 0.095·m past that. The tiled kernel walks K in
/// 64-wide steps, one at a time per block, about 12 ns per K column, longer once its
/// blocks pass about 160 (its occupancy). Both sides scale with cols, so it cancels. The
/// kernels give the same bits, so this choice changes speed only.
fn small_is_faster(base: &str, m: usize, rows: usize, tiled_blocks: usize) -> bool {
    let mats = if base.contains("glu") { 2.0 } else { 1.0 };
    let ps_per_element = match m {
        0..=4 => 1.0,
        5..=16 => 1.6,
        _ => 0.095 * m as f64,
    };
    let tiled_ps_per_col = 12_000.0 * (tiled_blocks as f64 / 160.0).max(1.0);
    ps_per_element * mats * rows as f64 <= tiled_ps_per_col
}

impl QgemmKernel {
    /// The kernel name for `base` ("qgemm", "qgemm_f32", "qgemm_glu") at m tokens of cols
    /// values, and its launch shape for `rows` outputs (`rows_per_tile`: the tiled kernel's
    /// rows per block). `wide`: whether Auto may take the wide tiles.
    fn pick(
        self,
        base: &str,
        (m, cols): (usize, usize),
        (rows, rows_per_tile): (usize, usize),
        wide: bool,
    ) -> Result<(String, LaunchConfig)> {
        let kernel = match self {
            QgemmKernel::Auto if m <= SMALL_M && small_is_faster(base, m, rows, rows.div_ceil(rows_per_tile)) => {
                QgemmKernel::Small
            }
            QgemmKernel::Auto if wide && m >= WIDE_MIN_M && rows >= WIDE_MIN_ROWS => QgemmKernel::Wide,
            QgemmKernel::Auto => QgemmKernel::Tiled,
            k => k,
        };
        if kernel == QgemmKernel::Wgmma {
            return Err(Error::Invalid("the wgmma qgemm launches through gemm_wgmma.rs".into()));
        }
        if kernel == QgemmKernel::Small {
            if m > SMALL_M {
                return Err(Error::Invalid(format!("the few-token qgemm takes at most {SMALL_M} tokens, not {m}")));
            }
            let tiles = if m <= SMALL_M1 { 1 } else { 4 };
            let name = format!("{}_m{tiles}", base.replacen("qgemm", "qgemm_small", 1));
            let grid = (rows.div_ceil(SMALL_ROWS) as u32, 1, 1);
            let threads = 32 * cols.div_ceil(CHUNK_K).clamp(1, SMALL_WARPS) as u32;
            return Ok((name, LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: 0 }));
        }
        let (tokens, suffix) = match kernel {
            QgemmKernel::Wide => (2 * TILE_TOKENS, "_w128"),
            _ => (TILE_TOKENS, ""),
        };
        let grid = (rows.div_ceil(rows_per_tile) as u32, m.div_ceil(tokens) as u32, 1);
        if grid.1 > 65535 {
            return Err(Error::Unsupported(format!("CUDA qgemm: {m} tokens in one call")));
        }
        let block = (2 * tokens as u32, 1, 1); // gemm.cu: 2·BM threads
        Ok((format!("{base}{suffix}"), LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: 0 }))
    }
}

impl Cuda {
    /// Can [`Cuda::qgemm`] multiply by `w`? (Affine weights with cols a multiple of 32.)
    pub fn qgemm_supported(&self, w: &CudaMat) -> bool {
        matches!(w, CudaMat::Affine { cols, .. } if cols.is_multiple_of(COLS_MULTIPLE))
    }

    /// out = x · wᵀ on the tensor cores: x bf16 `[m, cols]`, out bf16 or f32 `[m, rows]`.
    pub fn qgemm(&self, x: &CudaAct, w: &CudaMat, out: &mut CudaAct) -> Result<()> {
        self.qgemm_as(x, w, out, QgemmKernel::Auto)
    }

    /// `qgemm` on the given kernel.
    pub fn qgemm_as(&self, x: &CudaAct, w: &CudaMat, out: &mut CudaAct, kernel: QgemmKernel) -> Result<()> {
        let (rows, cols) = (w.rows(), w.cols());
        if x.cols != cols || out.cols != rows || out.rows != x.rows {
            return Err(Error::Invalid(format!(
                "CUDA qgemm shapes: x [{}, {}], w [{rows}, {cols}], out [{}, {}]",
                x.rows, x.cols, out.rows, out.cols
            )));
        }
        let ActBuf::Bf16(xb) = &x.buf else {
            return Err(Error::Invalid("CUDA qgemm takes bf16 activations, not f32".into()));
        };
        let CudaMat::Affine { words, scales, biases, defines, bits, group, .. } = w else {
            return Err(Error::Unsupported("CUDA qgemm needs affine-quantized weights (got dense bf16)".into()));
        };
        if !cols.is_multiple_of(COLS_MULTIPLE) {
            return Err(Error::Unsupported(format!(
                "CUDA qgemm needs cols a multiple of {COLS_MULTIPLE} ({bits}-bit weights, group {group}, cols {cols}); use the GEMV"
            )));
        }
        if x.rows == 0 || rows == 0 {
            return Ok(());
        }
        // The kernel takes the sizes as int (and indexes memory in size_t).
        if [rows, cols, x.rows].iter().any(|&v| i32::try_from(v).is_err()) {
            return Err(Error::Unsupported(format!(
                "CUDA qgemm sizes past 2^31: x [{}, {cols}], w [{rows}, {cols}]",
                x.rows
            )));
        }
        if self.takes_wgmma(kernel, x.rows, (rows, cols))? {
            return self.qgemm_wgmma(x, (w, None), out, false);
        }
        let f32_out = matches!(out.buf, ActBuf::F32(_));
        let base = if f32_out { "qgemm_f32" } else { "qgemm" };
        let (name, cfg) = kernel.pick(base, (x.rows, cols), (rows, TILE_ROWS), self.cfg.gemm_wide_tiles)?;
        let func = self.function(kernels::file("gemm.cu"), defines, &name)?;
        let (rows_i, cols_i, m_i) = (rows as i32, cols as i32, x.rows as i32);
        let args = [
            self.arg(words),
            scales.arg(self),
            biases.arg(self),
            self.arg(xb),
            out.arg(self),
            KArg::I32(rows_i),
            KArg::I32(cols_i),
            KArg::I32(m_i),
        ];
        // Matches gemm.cu's qgemm / qgemm_f32 (or their few-token forms) for the output's
        // dtype; shapes checked above.
        self.launch(&func, cfg, &args, Order::Serial, "qgemm launch")
    }

    /// out = act(x·gateᵀ) · (x·upᵀ) in one launch (gemm.cu's qgemm_glu): x bf16 `[m, cols]`,
    /// gate and up `[rows, cols]` of one affine format, out bf16 `[m, rows]`. Ok(false),
    /// nothing launched, where it does not apply (formats or shapes differ, dense weights).
    pub fn qgemm_glu(
        &self,
        x: &CudaAct,
        (gate, up): (&CudaMat, &CudaMat),
        act: Activation,
        out: &mut CudaAct,
    ) -> Result<bool> {
        self.qgemm_glu_as(x, (gate, up), act, out, QgemmKernel::Auto)
    }

    /// `qgemm_glu` on the given kernel.
    pub fn qgemm_glu_as(
        &self,
        x: &CudaAct,
        (gate, up): (&CudaMat, &CudaMat),
        act: Activation,
        out: &mut CudaAct,
        kernel: QgemmKernel,
    ) -> Result<bool> {
        let (
            CudaMat::Affine { words: gw, scales: gs, biases: gb, defines, rows, cols, .. },
            CudaMat::Affine { words: uw, scales: us, biases: ub, .. },
        ) = (gate, up)
        else {
            return Ok(false);
        };
        let same = same_format(gate, up) && cols.is_multiple_of(COLS_MULTIPLE);
        let (ActBuf::Bf16(xb), ActBuf::Bf16(_)) = (&x.buf, &out.buf) else { return Ok(false) };
        if !same || x.cols != *cols || out.cols != *rows || out.rows != x.rows {
            return Ok(false);
        }
        if x.rows == 0 || *rows == 0 {
            return Ok(true);
        }
        if [*rows, *cols, x.rows].iter().any(|&v| i32::try_from(v).is_err()) {
            return Ok(false);
        }
        if self.takes_wgmma(kernel, x.rows, (*rows, *cols))? {
            self.qgemm_wgmma(x, (gate, Some((up, act))), out, false)?;
            return Ok(true);
        }
        let (name, cfg) =
            kernel.pick("qgemm_glu", (x.rows, *cols), (*rows, TILE_ROWS / 2), self.cfg.gemm_wide_tiles)?;
        let func = self.function(kernels::file("gemm.cu"), defines, &name)?;
        let args = [
            self.arg(gw),
            gs.arg(self),
            gb.arg(self),
            self.arg(uw),
            us.arg(self),
            ub.arg(self),
            self.arg(xb),
            out.arg(self),
            KArg::I32(*rows as i32),
            KArg::I32(*cols as i32),
            KArg::I32(x.rows as i32),
            KArg::I32(i32::from(act == Activation::GeluTanh)),
        ];
        // Matches gemm.cu's qgemm_glu (or its few-token forms); shapes checked above.
        self.launch(&func, cfg, &args, Order::Serial, "qgemm_glu launch")?;
        Ok(true)
    }
}

/// Whether gate and up are of one affine format and shape (what the GLU GEMM needs).
pub(super) fn same_format(gate: &CudaMat, up: &CudaMat) -> bool {
    match (gate, up) {
        (CudaMat::Affine { defines: d, rows, cols, .. }, CudaMat::Affine { defines: ud, rows: ur, cols: uc, .. }) => {
            d == ud && (rows, cols) == (ur, uc)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cost model picks the faster kernel of `timings few` (H200, perf-log.md Session 30)
    /// in each measured case: (matrix, rows, cols, tokens, few-token µs, tiled µs).
    #[test]
    fn auto_picks_the_measured_faster_kernel() {
        let measured = [
            ("1B q/o", 2048, 2048, [(1, 5.98, 20.52), (4, 6.29, 20.33), (16, 7.53, 20.57), (32, 14.63, 20.65)]),
            ("1B gate", 8192, 2048, [(1, 14.17, 24.09), (4, 15.25, 24.06), (16, 26.47, 24.20), (64, 95.39, 25.97)]),
            ("1B down", 2048, 8192, [(1, 21.06, 102.30), (16, 27.35, 101.61), (32, 53.97, 101.01), (4, 21.92, 102.14)]),
            ("8B q/o", 4096, 4096, [(1, 13.88, 48.34), (16, 26.16, 48.40), (32, 64.23, 48.38), (64, 124.32, 50.81)]),
            ("8B gate", 14336, 4096, [(1, 40.69, 63.95), (4, 44.03, 63.96), (16, 96.40, 64.23), (32, 184.10, 64.32)]),
            (
                "8B down",
                4096,
                14336,
                [(1, 40.98, 168.38), (16, 85.15, 167.76), (32, 258.39, 168.68), (64, 423.45, 184.33)],
            ),
        ];
        for (name, rows, cols, cases) in measured {
            for (m, few, tiled) in cases {
                let (kernel, _) = QgemmKernel::Auto.pick("qgemm", (m, cols), (rows, TILE_ROWS), false).unwrap();
                let small = kernel.starts_with("qgemm_small");
                assert_eq!(small, few < tiled, "{name} at {m} tokens: picked {kernel}, measured {few} vs {tiled} µs");
            }
        }
        // Past 64 tokens only the tiles; wide ones from 128 tokens on matrices of 4096 rows.
        let pick = |m, rows, wide| QgemmKernel::Auto.pick("qgemm", (m, 4096), (rows, TILE_ROWS), wide).unwrap().0;
        assert_eq!(pick(65, 4096, true), "qgemm");
        assert_eq!(pick(128, 4096, true), "qgemm_w128");
        assert_eq!(pick(128, 2048, true), "qgemm");
        assert_eq!(pick(512, 14336, false), "qgemm");
    }
}
