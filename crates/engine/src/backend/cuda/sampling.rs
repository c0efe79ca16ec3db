//! Sampling on the device (kernels/sample.cu): the greedy argmax (fed to the next step on
//! the device when asked) and top-k candidates, so a step reads back 4 or 8·k bytes instead
//! of the vocabulary's logits.

use super::context::Order;
use super::device::Cuda;
use super::driver::KArg;
use super::gemv::ARGMAX_FUSED_BLOCKS_PER_SM;
use super::kernels;
use super::tensors::{ActBuf, CudaAct};
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;

/// Most blocks the argmax kernel uses (its scratch size).
pub(crate) const ARGMAX_BLOCKS: usize = 128;

impl Cuda {
    /// The argmax sink's arguments (argmax.cuh): the blocks' partials and done counter,
    /// then with `feed` the staged token, position and token history the next fed step
    /// reads, else nulls.
    pub(crate) fn argmax_sink(&self, feed: bool) -> Result<[KArg; 6]> {
        let n = ARGMAX_BLOCKS.max(ARGMAX_FUSED_BLOCKS_PER_SM * self.sms);
        let [pv, pi, done] = self.scratch.argmax(self, n)?;
        let [tok, pos, hist] = match feed {
            true => self.steps.feed_args(self)?,
            false => [KArg::Ptr(0); 3],
        };
        Ok([pv, pi, done, tok, pos, hist])
    }

    /// argmax of row 0 of f32 `x` into out[0] as f32; with `feed`, also into the staged
    /// token id with the staged position advanced (the next fed step's input).
    pub(crate) fn argmax_f32(&self, x: &CudaAct, out: &mut CudaAct, feed: bool) -> Result<()> {
        let (ActBuf::F32(xv), ActBuf::F32(ov)) = (&x.buf, &mut out.buf) else {
            return Err(Error::Invalid("CUDA argmax reads f32 logits into an f32 output".into()));
        };
        let f = self.function(kernels::file("sample.cu"), &[], "argmax")?;
        let n = x.cols as i32;
        // ~2K values per block: enough blocks to stream a 128K vocabulary in parallel.
        let blocks = x.cols.div_ceil(2048).clamp(1, ARGMAX_BLOCKS);
        let [pv, pi, done, feed_tok, feed_pos, feed_hist] = self.argmax_sink(feed)?;
        let args = [self.arg(xv), KArg::I32(n), self.arg(ov), pv, pi, done, feed_tok, feed_pos, feed_hist];
        let c = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // Matches sample.cu's argmax.
        self.launch(&f, c, &args, Order::Overlap, "argmax launch")
    }

    /// The k best of row 0 of f32 `x` × inv_t as (index, value) pairs into out (sample.cu's
    /// top_k; arguments checked by the caller).
    pub(crate) fn top_k_f32(&self, x: &CudaAct, k: usize, inv_t: f32, out: &mut CudaAct) -> Result<()> {
        let (ActBuf::F32(xv), ActBuf::F32(ov)) = (&x.buf, &mut out.buf) else {
            return Err(Error::Invalid("CUDA top-k reads f32 logits into an f32 output".into()));
        };
        let f = self.function(kernels::file("sample.cu"), &[], "top_k")?;
        let n = x.cols;
        let (blocks, per) = top_k_split(n, k);
        let [ck, ci, done] = self.scratch.top_k(self, TOP_K_CAP)?;
        let args = [
            self.arg(xv),
            KArg::I32(n as i32),
            KArg::F32(inv_t),
            KArg::I32(k as i32),
            KArg::I32(per as i32),
            KArg::I32(TOP_K_CAP as i32),
            ck,
            ci,
            done,
            self.arg(ov),
        ];
        let c = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: (TOP_K_CAP * 4) as u32,
        };
        // Matches sample.cu's top_k: blocks · k ≤ TOP_K_CAP candidates (top_k_split), done
        // zeroed at allocation and reset by the kernel.
        self.launch(&f, c, &args, Order::Overlap, "top-k launch")
    }
}

/// Keys sample.cu's top_k holds in shared memory (a slice in phase 1, all candidates in
/// phase 2), and the candidate scratch's size: 43 KB, within the 48 KB a launch gets.
const TOP_K_CAP: usize = 11008;

/// (blocks, values per block) for top-k of k over n: slices of ~1K values spread a 128K
/// vocabulary over ~128 SMs, as long as the blocks' k candidates each fit TOP_K_CAP
/// together; each slice longer than k unless one block takes everything.
fn top_k_split(n: usize, k: usize) -> (usize, usize) {
    let blocks = (TOP_K_CAP / k).min(n.div_ceil(1024)).max(1);
    let per = n.div_ceil(blocks);
    if per <= k {
        return (1, n);
    }
    (n.div_ceil(per), per)
}

impl Cuda {
    /// `Backend::argmax_rows`: sample.cu's argmax_rows, a block per row.
    pub(crate) fn argmax_rows_f32(&self, x: &CudaAct, out: &mut CudaAct) -> Result<()> {
        crate::backend::check_argmax_rows(x.rows, x.cols, out.rows * out.cols)?;
        if !x.is_f32() || !out.is_f32() {
            return Err(Error::Invalid("CUDA argmax_rows takes f32 logits into f32".into()));
        }
        if x.rows == 0 {
            return Ok(());
        }
        let f = self.plain_kernel("sample.cu", "argmax_rows")?;
        let args = [x.arg(self), KArg::I32(x.cols as i32), out.arg(self)];
        let c = super::elementwise::cfg((x.rows as u32, 1), 1024);
        // Matches sample.cu's argmax_rows; out holds a value per row (checked above).
        self.launch(&f, c, &args, Order::Serial, "argmax_rows launch")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// top_k_split's promises to sample.cu's top_k: every value in a slice, at most
    /// TOP_K_CAP candidates, and slices longer than k unless one block takes everything
    /// (so only the last slice writes fewer than k).
    #[test]
    fn top_k_split_covers_and_fits() {
        for n in [1, 7, 1000, 1024, 1025, 5000, 49152, 128256, 262144] {
            for k in [1, 2, 40, 1000, 1024].into_iter().filter(|&k| k <= n) {
                let (blocks, per) = top_k_split(n, k);
                assert!(blocks >= 1 && (blocks - 1) * per < n && blocks * per >= n, "n {n} k {k}: {blocks} × {per}");
                assert!(blocks * k <= TOP_K_CAP, "n {n} k {k}: {blocks} blocks of {k}");
                assert!(blocks == 1 || per > k, "n {n} k {k}: slices of {per}");
            }
        }
        assert_eq!(top_k_split(128256, 40), (126, 1018));
    }
}
