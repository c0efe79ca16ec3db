//! The end of a decode layer as one launch (gemv.cu's `ffn`, FFN=1 variants): optionally
//! the o-projection + residual add, then norm → gate/up → SwiGLU, then down + residual
//! add, with the blocks counting themselves in between the phases instead of a kernel
//! boundary, so each phase's first weight tiles stream while the slowest blocks finish the
//! phase before. The first step toward a persistent decode kernel; off unless
//! `FERROLM_FFN_FUSED=1` (the MLP) or `=2` (o + the MLP), or `set_layer_end_fusion`,
//! until it has been measured against the launches it replaces. `=3` runs the MLP split
//! along the FFN dimension instead (ffn_splitk.cuh; `Cuda::ffn_splitk`).

use super::device::{drv, ActBuf, Cuda, CudaAct, CudaMat, DevScales, KArg, SplitkGrid};
use super::fused::{dev, gemv_defines, gemv_warps, k_slices, scales_ptr, x_staging, GemvOut};
use super::gemv_ring::ring_x_bytes;
use super::kernels;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};
use std::sync::atomic::Ordering::Relaxed;

/// What `Backend::o_proj_mlp` fuses on CUDA for a decode row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerEndFusion {
    /// Separate launches: o + add, norm → gate/up → SwiGLU, down + add.
    None = 0,
    /// The MLP's two launches as one; o + add on its own.
    Mlp = 1,
    /// o + add and the MLP, one launch.
    OProjMlp = 2,
    /// The MLP as one launch split along the FFN dimension in thread-block clusters
    /// (ffn_splitk.cuh): not bit-identical to the others (down sums in another order).
    SplitK = 3,
}

/// An MLP's three matrices as its one-launch kernels take them: one weight format, gate
/// and up [ffn, hidden], down [hidden, ffn], for a row x (f32 [1, hidden]) and act (bf16
/// [1, ffn]).
struct MlpParts<'a> {
    defines: &'a [String],
    hidden: usize,
    ffn: usize,
    bits: usize,
    /// (words, scales, biases) of gate, up and down: the kernels' first nine arguments.
    weights: [KArg; 9],
}

fn mlp_parts<'a>(
    c: &Cuda,
    (gate, up, down): (&'a CudaMat, &'a CudaMat, &'a CudaMat),
    x: &CudaAct,
    act: &CudaAct,
) -> Option<MlpParts<'a>> {
    let (
        CudaMat::Affine { defines, words: wg, scales: sg, biases: bg, rows: ffn, cols: hidden, bits, .. },
        CudaMat::Affine { defines: du, words: wu, scales: su, biases: bu, rows: ffn_u, cols: hidden_u, .. },
        CudaMat::Affine { defines: dd, words: wd, scales: sd, biases: bd, rows: hidden_d, cols: ffn_d, .. },
    ) = (gate, up, down)
    else {
        return None;
    };
    let shapes_ok = (ffn, hidden) == (ffn_u, hidden_u) && (hidden, ffn) == (hidden_d, ffn_d);
    let bufs_ok = matches!((&x.buf, &act.buf), (ActBuf::F32(_), ActBuf::Bf16(_)))
        && (x.rows, x.cols, act.rows, act.cols) == (1, *hidden, 1, *ffn);
    if !shapes_ok || !bufs_ok || defines != du || defines != dd {
        return None;
    }
    let w = |words, s, b| [dev(c, words), KArg::Ptr(scales_ptr(c, s)), KArg::Ptr(scales_ptr(c, b))];
    let [g, u, d] = [w(wg, sg, bg), w(wu, su, bu), w(wd, sd, bd)];
    let weights = [g[0], g[1], g[2], u[0], u[1], u[2], d[0], d[1], d[2]];
    Some(MlpParts { defines, hidden: *hidden, ffn: *ffn, bits: *bits as usize, weights })
}

impl Cuda {
    /// What `Backend::o_proj_mlp` runs as one launch.
    pub fn layer_end_fusion(&self) -> LayerEndFusion {
        match self.ffn_fused.load(Relaxed) {
            1 => LayerEndFusion::Mlp,
            2 => LayerEndFusion::OProjMlp,
            3 => LayerEndFusion::SplitK,
            _ => LayerEndFusion::None,
        }
    }

    /// What a layer end over `x` fuses: `layer_end_fusion` for one decode row, else nothing
    /// (the fused kernels take one row).
    pub(crate) fn layer_end_fusion_for(&self, x: &CudaAct) -> LayerEndFusion {
        if x.rows == 1 {
            self.layer_end_fusion()
        } else {
            LayerEndFusion::None
        }
    }

    /// Choose what `Backend::o_proj_mlp` fuses (tests compare them on one device).
    pub fn set_layer_end_fusion(&self, f: LayerEndFusion) {
        self.ffn_fused.store(f as u8, Relaxed);
        self.decode_path_changed();
    }

    /// For one row, as one launch: x += o·att when `o` is given, then x += down(silu(gate(n(x)))
    /// · up(n(x))), n the RMSNorm with `gains`; `act` gets the SwiGLU output. Ok(false) when
    /// the kernels do not cover the case (the caller then runs the separate launches).
    pub fn ffn_fused(
        &self,
        x: &mut CudaAct,
        o: Option<(&CudaAct, &CudaMat)>,
        (gains, eps): (&CudaSlice<f32>, f32),
        (gate, up, down): (&CudaMat, &CudaMat, &CudaMat),
        act: &mut CudaAct,
    ) -> Result<bool> {
        let Some(MlpParts { defines, hidden, ffn, bits, weights }) = mlp_parts(self, (gate, up, down), x, act) else {
            return Ok(false);
        };
        let (xq, smem_in) = x_staging(hidden);
        let (xq_act, smem_act) = x_staging(ffn);
        // One XQ define serves every phase's staging.
        if xq != xq_act {
            return Ok(false);
        }
        let nw = gemv_warps();
        // The o phase: (rows per warp and K slices, staging bytes, its arguments), or none.
        let ((ro, ko), smem_o, o_args) = match o {
            None => ((0, 1), 0, [KArg::Ptr(0), KArg::Ptr(0), KArg::Ptr(0), KArg::Ptr(0), KArg::I32(0)]),
            Some((att, wo)) => {
                let CudaMat::Affine { defines: dw, words, scales, biases, rows, cols, .. } = wo else {
                    return Ok(false);
                };
                let (xq_att, smem_att) = x_staging(*cols);
                let ActBuf::Bf16(a) = &att.buf else { return Ok(false) };
                if dw != defines || (*rows, att.rows, att.cols) != (hidden, 1, *cols) || xq_att != xq {
                    return Ok(false);
                }
                let args = [
                    dev(self, words),
                    KArg::Ptr(scales_ptr(self, scales)),
                    KArg::Ptr(scales_ptr(self, biases)),
                    dev(self, a),
                    KArg::I32(*cols as i32),
                ];
                let chunks = cols * bits / 128;
                (
                    k_slices(GemvOut::Add, self.gemv_rows_per_warp(GemvOut::Add, hidden, chunks), chunks, nw),
                    smem_att,
                    args,
                )
            }
        };
        // Rows per warp and K slices as the separate launches choose them (the same sums, bit
        // for bit).
        let ru = self.gemv_rows_per_warp(GemvOut::Swiglu, ffn, hidden * bits / 128);
        let dchunks = ffn * bits / 128;
        let (rd, kd) = k_slices(GemvOut::Add, self.gemv_rows_per_warp(GemvOut::Add, hidden, dchunks), dchunks, nw);
        let mut defines = gemv_defines(defines, xq);
        defines.extend([
            "FFN=1".into(),
            format!("FFN_RO={ro}"),
            format!("FFN_RU={ru}"),
            format!("FFN_RD={rd}"),
            format!("FFN_KO={ko}"),
            format!("FFN_KD={kd}"),
        ]);
        let f = self.function(kernels::file("gemv.cu"), &defines, "ffn")?;
        let smem = smem_in.max(smem_act).max(smem_o);
        let threads = 32 * nw as u32;
        // Every block must be resident at once (they wait for each other): never more than
        // the occupancy allows, which gemv_grid's cap already is.
        let mut steps = ffn.div_ceil(nw * ru).max(hidden.div_ceil(nw / kd * rd));
        if ro > 0 {
            steps = steps.max(hidden.div_ceil(nw / ko * ro));
        }
        let blocks = steps.min(self.gemv_grid(&f, threads, smem));
        let mut sync = self.ffn_sync.lock().unwrap_or_else(|e| e.into_inner());
        if sync.is_none() {
            *sync = Some(self.stream.alloc_zeros::<i32>(3).map_err(drv("allocating the layer-end counters"))?);
        }
        let sync = sync.as_ref().expect("set above");
        let (ActBuf::F32(xv), ActBuf::Bf16(av)) = (&x.buf, &act.buf) else { unreachable!("checked above") };
        let mut args = o_args.to_vec();
        args.extend(weights);
        args.extend([
            dev(self, xv),
            KArg::Ptr(gains.device_ptr(&self.stream).0),
            KArg::F32(eps),
            KArg::I32(hidden as i32),
            dev(self, av),
            KArg::I32(ffn as i32),
            dev(self, sync),
        ]);
        let c =
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
        // Matches gemv.cu's ffn; the counters are zeroed at allocation and reset by the
        // kernel's last block.
        self.launch(&f, c, &args, "fused layer-end launch")?;
        Ok(true)
    }

    /// For one row, as one launch: x += down(silu(gate(n(x))) · up(n(x))), split along the
    /// FFN dimension (ffn_splitk.cuh): each block's run of gate/up rows, then those columns
    /// of down,
    /// the partials reduced per cluster through DSMEM and across clusters in a fixed order.
    /// `act` gets the SwiGLU output. Ok(false) where it does not apply (2-bit weights, steps
    /// not whole 16-byte chunks, no clusters): the caller runs the separate launches.
    pub fn ffn_splitk(
        &self,
        x: &mut CudaAct,
        (gains, eps): (&CudaSlice<f32>, f32),
        (gate, up, down): (&CudaMat, &CudaMat, &CudaMat),
        act: &mut CudaAct,
    ) -> Result<bool> {
        let Some(MlpParts { defines, hidden, ffn, bits, weights }) = mlp_parts(self, (gate, up, down), x, act) else {
            return Ok(false);
        };
        let nw = gemv_warps();
        // gate/up rows per warp (SPLITK_R); a step of nw·R rows must be whole down chunks.
        const R: usize = 4;
        let (rb, vpc) = (nw * R, 128 / bits);
        let ok = self.clusters && bits >= 4 && rb.is_multiple_of(vpc) && ffn.is_multiple_of(vpc);
        if !ok {
            return Ok(false);
        }
        let steps = ffn.div_ceil(rb);
        let (xq, _) = x_staging(hidden);
        let mut defines = gemv_defines(defines, xq);
        defines.extend(["SPLITK=1".into(), format!("SPLITK_R={R}")]);
        let f = self.function(kernels::file("gemv.cu"), &defines, "ffn_splitk_r")?;
        // x staging, then the block's partial sums (hidden) and its act values, then its
        // columns of down (ffn_splitk.cuh).
        let smem_for = |nb: usize| {
            let rows = steps / nb * rb;
            ring_x_bytes(hidden, xq) + (4 * (hidden + rows)).div_ceil(16) * 16 + hidden * rows * bits / 8
        };
        let Some((nb, cs)) = self.splitk_grid(&f, (steps, hidden, bits), nw, &smem_for)? else {
            return Ok(false); // no grid of whole, co-resident clusters (or down's columns do not fit)
        };
        let smem = smem_for(nb);
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(drv("split-K MLP shared memory"))?;
        let mut scratch = self.splitk_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let key = (nb / cs, hidden);
        if let std::collections::hash_map::Entry::Vacant(e) = scratch.entry(key) {
            let part = self.stream.alloc_zeros::<f32>(key.0 * hidden).map_err(drv("allocating split-K partials"))?;
            let done =
                self.stream.alloc_zeros::<i32>(SPLITK_CLUSTERS[0]).map_err(drv("allocating split-K counters"))?;
            e.insert((part, done));
        }
        let (part, done) = &scratch[&key];
        let (st, bt) = self.down_transposed(down)?;
        let mut weights = weights;
        weights[7] = KArg::Ptr(st);
        weights[8] = KArg::Ptr(bt);
        let (ActBuf::F32(xv), ActBuf::Bf16(av)) = (&x.buf, &act.buf) else { unreachable!("checked above") };
        let mut args = weights.to_vec();
        args.extend([
            dev(self, xv),
            KArg::Ptr(gains.device_ptr(&self.stream).0),
            KArg::F32(eps),
            KArg::I32(hidden as i32),
            KArg::I32(ffn as i32),
            dev(self, av),
            dev(self, part),
            dev(self, done),
        ]);
        let c = LaunchConfig {
            grid_dim: (nb as u32, 1, 1),
            block_dim: (32 * nw as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // Matches ffn_splitk.cuh's ffn_splitk_r; `done` zeroed at allocation, reset by the kernel.
        self.launch_clustered(&f, c, &args, "split-K MLP launch", cs as u32)?;
        self.splitk_launches.fetch_add(1, Relaxed);
        Ok(true)
    }

    /// The split-K MLP's grid for (gate/up steps, hidden, bits): (blocks, cluster size), the
    /// most blocks that are whole clusters of 8, 4 or 2 (the larger at a tie), divide the
    /// steps, split the hidden rows evenly over a cluster's ranks, fit down's columns in
    /// shared memory (`smem_for(blocks)`), and all run at once: on the H200 15 clusters of 8
    /// fit, not 16, and the 1B's 16 ran the last as a second wave (33 µs per launch in ncu,
    /// SMs active 46% of it). Chosen once per shape (the occupancy queries are not free).
    fn splitk_grid(
        &self,
        f: &cudarc::driver::CudaFunction,
        key: (usize, usize, usize),
        nw: usize,
        smem_for: &dyn Fn(usize) -> usize,
    ) -> Result<Option<SplitkGrid>> {
        if let Some(g) = self.splitk_grid.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(*g);
        }
        let (steps, hidden, _) = key;
        let mut best: Option<SplitkGrid> = None;
        for cs in SPLITK_CLUSTERS {
            if !hidden.is_multiple_of(cs) {
                continue;
            }
            for nb in splitk_block_counts(steps, self.sms, cs) {
                let smem = smem_for(nb);
                if smem + 1024 > self.smem_optin || best.is_some_and(|(b, _)| b >= nb) {
                    continue;
                }
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(drv("split-K MLP shared memory"))?;
                let c = LaunchConfig {
                    grid_dim: (nb as u32, 1, 1),
                    block_dim: (32 * nw as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                if self.max_active_clusters(f, c, cs as u32)? * cs >= nb {
                    best = Some((nb, cs));
                    break;
                }
            }
        }
        self.splitk_grid.lock().unwrap_or_else(|e| e.into_inner()).insert(key, best);
        Ok(best)
    }

    /// Device addresses of down's scales and biases transposed to [groups][rows] (made on
    /// the first call for this matrix, outside any capture: a decode step runs once
    /// un-captured before its capture).
    fn down_transposed(&self, down: &CudaMat) -> Result<(u64, u64)> {
        let CudaMat::Affine { words, scales, biases, rows, cols, group, .. } = down else {
            return Err(Error::Invalid("split-K MLP: down is not an affine matrix".into()));
        };
        let key = words.device_ptr(&self.stream).0;
        let mut cache = self.splitk_down_t.lock().unwrap_or_else(|e| e.into_inner());
        if let std::collections::hash_map::Entry::Vacant(e) = cache.entry(key) {
            if self.capturing.load(Relaxed) {
                return Err(Error::Invalid(
                    "split-K MLP: down's transposed scales were not made before the capture".into(),
                ));
            }
            let groups = cols / group;
            let t = |s: &DevScales| -> Result<DevScales> {
                let what = "transposing down's scales";
                Ok(match s {
                    DevScales::Half(v) => DevScales::Half(self.upload(
                        &transpose_groups(&self.stream.clone_dtoh(v).map_err(drv(what))?, *rows, groups),
                        what,
                    )?),
                    DevScales::F32(v) => DevScales::F32(self.upload(
                        &transpose_groups(&self.stream.clone_dtoh(v).map_err(drv(what))?, *rows, groups),
                        what,
                    )?),
                })
            };
            e.insert((t(scales)?, t(biases)?));
        }
        let (s, b) = &cache[&key];
        Ok((scales_ptr(self, s), scales_ptr(self, b)))
    }

    /// Split-K MLP launches so far (queued or captured).
    pub fn ffn_splitk_launches(&self) -> usize {
        self.splitk_launches.load(Relaxed)
    }
}

/// Per-row group values [rows][groups] as [groups][rows].
fn transpose_groups<T: Copy + Default>(v: &[T], rows: usize, groups: usize) -> Vec<T> {
    let mut o = vec![T::default(); v.len()];
    for r in 0..rows {
        for g in 0..groups {
            o[g * rows + r] = v[r * groups + g];
        }
    }
    o
}

/// Cluster sizes the split-K MLP tries, largest first (8 is the portable maximum).
const SPLITK_CLUSTERS: [usize; 3] = [8, 4, 2];

/// Block counts for the split-K MLP, most first: whole clusters of `cs`, at most `sms`,
/// dividing the gate/up `steps` (each block takes a contiguous run of them).
fn splitk_block_counts(steps: usize, sms: usize, cs: usize) -> impl Iterator<Item = usize> {
    (1..=steps.min(sms) / cs).rev().map(move |n| n * cs).filter(move |n| steps.is_multiple_of(*n))
}

#[cfg(test)]
mod tests {
    use super::{splitk_block_counts, transpose_groups};

    #[test]
    fn group_values_transpose() {
        // 2 rows × 3 groups
        assert_eq!(transpose_groups(&[1, 2, 3, 4, 5, 6], 2, 3), vec![1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn splitk_block_counts_for_real_shapes() {
        let first = |steps, cs| splitk_block_counts(steps, 132, cs).next();
        // 32-row steps on a 132-SM device: 1B (ffn 8192), SmolLM2 (1536), 8B (14336)
        assert_eq!(first(256, 8), Some(128));
        assert_eq!(first(48, 8), Some(48));
        assert_eq!(first(448, 8), Some(112));
        // no whole cluster divides 7 steps
        assert_eq!(first(7, 8), None);
        // the H200 runs 15 clusters of 8 at once: the next count for the 1B is 64 blocks,
        // so clusters of 4 (128 blocks) win there
        assert_eq!(splitk_block_counts(256, 120, 8).next(), Some(64));
        assert_eq!(splitk_block_counts(256, 132, 4).collect::<Vec<_>>()[..3], [128, 64, 32]);
    }
}
