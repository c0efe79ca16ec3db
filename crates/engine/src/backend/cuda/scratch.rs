//! Device buffers the ops make on first use and keep for the process: captured graphs
//! point at them, so none is ever freed or moved. Each is made outside any capture (in the
//! dry pass a decode step gets first, `Context::dry_pass`).

use super::context::Context;
use super::driver::KArg;
use crate::backend::Rope;
use crate::Result;
use cudarc::driver::CudaSlice;
use std::collections::HashMap;
use std::sync::Mutex;

/// Argmax partials, (value, index) per block, and the done counter (argmax.cuh's sink).
type ArgmaxScratch = (CudaSlice<f32>, CudaSlice<i32>, CudaSlice<i32>);
/// Top-k candidates (key, index) and the done counter (sample.cu's top_k).
type TopKScratch = (CudaSlice<u32>, CudaSlice<i32>, CudaSlice<i32>);
/// Decode attention's partial max/sum, partial outputs and per-head done counters.
type AttnScratch = (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<i32>);

#[derive(Default)]
pub(crate) struct Scratch {
    /// RoPE inverse frequencies, one upload per distinct table.
    rope_freqs: Mutex<Vec<(Vec<f32>, CudaSlice<f32>)>>,
    argmax: Mutex<Option<ArgmaxScratch>>,
    top_k: Mutex<Option<TopKScratch>>,
    /// By (heads, splits, head_dim).
    attention: Mutex<HashMap<(usize, usize, usize), AttnScratch>>,
    /// The staged x images (x_staged.cuh) by byte size.
    staged_x: Mutex<HashMap<usize, CudaSlice<u8>>>,
    /// The wgmma GEMM's bf16 weight copy (gemm_wgmma.rs), grown by replacement: the calls
    /// that use it are never captured, and the old buffer is freed in stream order.
    wgmma_weights: Mutex<Option<CudaSlice<u16>>>,
    /// A prefill's layers dequantized one layer ahead (gemm_wgmma.rs).
    pub(crate) wgmma_ahead: Mutex<super::gemm_wgmma::Ahead>,
}

impl Scratch {
    /// Device address of `rope`'s inverse frequencies.
    pub(crate) fn rope_freqs(&self, ctx: &Context, rope: &Rope) -> Result<KArg> {
        let mut cache = self.rope_freqs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, d)) = cache.iter().find(|(v, _)| v == &rope.inv_freq) {
            return Ok(ctx.arg(d));
        }
        let d = ctx.upload(&rope.inv_freq, "uploading RoPE frequencies")?;
        let p = ctx.arg(&d);
        cache.push((rope.inv_freq.clone(), d));
        Ok(p)
    }

    /// The argmax sink's partials (`n` blocks at most) and done counter, shared by
    /// sample.cu's argmax and the head's fused one (launches on one stream; each last
    /// block resets the counter).
    pub(crate) fn argmax(&self, ctx: &Context, n: usize) -> Result<[KArg; 3]> {
        let mut s = self.argmax.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            let what = "allocating argmax scratch";
            *s = Some((ctx.zeros(n, what)?, ctx.zeros(n, what)?, ctx.zeros(1, what)?));
        }
        let (v, i, d) = s.as_ref().expect("set above");
        Ok([ctx.arg(v), ctx.arg(i), ctx.arg(d)])
    }

    /// Top-k candidate keys and indices (`cap` each) and the done counter.
    pub(crate) fn top_k(&self, ctx: &Context, cap: usize) -> Result<[KArg; 3]> {
        let mut s = self.top_k.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            let what = "allocating top-k scratch";
            *s = Some((ctx.zeros(cap, what)?, ctx.zeros(cap, what)?, ctx.zeros(1, what)?));
        }
        let (k, i, d) = s.as_ref().expect("set above");
        Ok([ctx.arg(k), ctx.arg(i), ctx.arg(d)])
    }

    /// Decode attention's scratch for `heads` heads of `splits` splits each.
    pub(crate) fn attention(&self, ctx: &Context, heads: usize, splits: usize, head_dim: usize) -> Result<[KArg; 3]> {
        let mut m = self.attention.lock().unwrap_or_else(|e| e.into_inner());
        let key = (heads, splits, head_dim);
        if let std::collections::hash_map::Entry::Vacant(e) = m.entry(key) {
            let what = "allocating attention scratch";
            let n = heads * splits;
            e.insert((ctx.zeros(2 * n, what)?, ctx.zeros(n * head_dim, what)?, ctx.zeros(heads, what)?));
        }
        let (ml, acc, done) = &m[&key];
        Ok([ctx.arg(ml), ctx.arg(acc), ctx.arg(done)])
    }

    /// A staged x image of `bytes` bytes (one per size).
    pub(crate) fn staged_x(&self, ctx: &Context, bytes: usize) -> Result<KArg> {
        let mut m = self.staged_x.lock().unwrap_or_else(|e| e.into_inner());
        if let std::collections::hash_map::Entry::Vacant(e) = m.entry(bytes) {
            e.insert(ctx.zeros(bytes, "allocating a staged x image")?);
        }
        Ok(ctx.arg(&m[&bytes]))
    }

    /// The wgmma GEMM's weight copy, at least `n` bf16 values.
    pub(crate) fn wgmma_weights(&self, ctx: &Context, n: usize) -> Result<KArg> {
        let mut b = self.wgmma_weights.lock().unwrap_or_else(|e| e.into_inner());
        if b.as_ref().is_none_or(|s| s.len() < n) {
            *b = None;
            *b = Some(ctx.zeros(n, "allocating the wgmma GEMM's weight copy")?);
        }
        Ok(ctx.arg(b.as_ref().expect("set above")))
    }
}
