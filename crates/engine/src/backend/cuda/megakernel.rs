//! The decode megakernel (kernels/decode_layers.cuh, gemv.cu's MEGA=1 variant): every
//! layer of a one-token decode step in one persistent launch, one block per SM, the
//! weights of the phases ahead bulk-copied into a shared-memory ring as its stages free up.
//! `FERROLM_MEGAKERNEL=1` turns it on (`Cuda::set_megakernel` in tests).
//!
//! Here: which models it takes (every layer matrix one affine format, ring-copyable rows,
//! bf16 cache), its plan (rows per warp per phase, ring stages, shared memory), and the
//! parameter block it reads (`MkParams` and one `MkLayer` per layer, written once per
//! model, cache and buffers, and kept: captured graphs point at it).

use super::device::{drv, ActBuf, Cuda, CudaAct, CudaKv, CudaMat, DevScales, KArg};
use super::fused::{act_ptr, gemv_defines, gemv_warps, scales_ptr, x_staging};
use super::gemv_ring::{ring_aligned, ring_x_bytes, whole_scale_pieces};
use super::kernels;
use crate::backend::{DecodeBufs, LayerWeights, Rope};
use crate::config::RopeStyle;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as Attr;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

/// The kernel's ring stage bound (MK_STAGES_MAX in decode_layers.cuh).
const STAGES_MAX: usize = 16;

/// Largest row step (bytes of one ring stage): 36 KB is a 1B model's 32 rows of 2048-wide
/// 4-bit weights with their scales, or 8 rows of its 8192-wide down projection; five such
/// stages fit beside the 8192-wide x. `FERROLM_MK_STAGE_KB` overrides (for tuning).
fn stage_cap() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("FERROLM_MK_STAGE_KB")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|k| (4..=96).contains(k))
            .unwrap_or(36)
            * 1024
    })
}

/// Most attention splits per query-head block (the scratch is sized for them; the kernel
/// splits by the position, ~64 positions each, at most a grid's worth).
const ATTN_SPLITS_MAX: usize = 1024;

/// One GEMV phase as the plan sees it: the rows of its matrices, their width, and whether
/// it is SwiGLU's pair (one step covers both).
pub(super) struct PhaseShape<'a> {
    pub rows: &'a [usize],
    pub cols: usize,
    pub two: bool,
}

/// How the megakernel runs for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MkPlan {
    /// Rows per warp of the q/k/v, o, gate/up and down phases.
    pub r: [usize; 4],
    pub stage_bytes: usize,
    pub stages: usize,
    pub x_bytes: usize,
    /// Dynamic shared memory per block.
    pub smem: usize,
}

/// The plan for phases `ph` of a (bits, group, scale bytes) format, with `warps` consumer
/// warps, x staged as int16 (`xq`) and `room` bytes of dynamic shared memory per block.
/// None where a phase's rows cannot be bulk-copied in whole 16-byte pieces or the ring
/// would hold fewer than two stages.
pub(super) fn mk_plan(
    ph: &[PhaseShape; 4],
    (bits, group, scale_bytes): (usize, usize, usize),
    warps: usize,
    xq: bool,
    room: usize,
) -> Option<MkPlan> {
    let mut rows_per_warp = [0; 4];
    let mut stage_bytes = 0;
    for (i, p) in ph.iter().enumerate() {
        if !(p.cols * bits).is_multiple_of(128) || !p.cols.is_multiple_of(group) {
            return None;
        }
        let rowbytes = p.cols * bits / 8;
        let srow = scale_bytes * (p.cols / group);
        let nm = if p.two { 2 } else { 1 };
        let fits = |per_warp: usize| {
            let rb = warps * per_warp;
            let step = (nm * rb * (rowbytes + 2 * srow)).div_ceil(128) * 128;
            (step <= stage_cap() && whole_scale_pieces(p.rows, rb, srow)).then_some(step)
        };
        let (ri, step) = [4, 2, 1].into_iter().find_map(|n| fits(n).map(|s| (n, s)))?;
        rows_per_warp[i] = ri;
        stage_bytes = stage_bytes.max(step);
    }
    let max_cols = ph.iter().map(|p| p.cols).max()?;
    let x_bytes = ring_x_bytes(max_cols, xq);
    let stages = (room.checked_sub(x_bytes)? / stage_bytes).min(STAGES_MAX);
    (stages >= 2).then_some(MkPlan {
        r: rows_per_warp,
        stage_bytes,
        stages,
        x_bytes,
        smem: x_bytes + stages * stage_bytes,
    })
}

/// The parameter block the kernel reads: MkParams (176 bytes; decode_layers.cuh asserts
/// the size), padded to 256, then one 256-byte MkLayer per layer. Little-endian, C layout.
#[derive(Default)]
struct Block(Vec<u8>);

impl Block {
    fn ptr(&mut self, p: u64) -> &mut Self {
        self.0.extend_from_slice(&p.to_le_bytes());
        self
    }
    fn i32(&mut self, v: usize) -> &mut Self {
        self.0.extend_from_slice(&(v as i32).to_le_bytes());
        self
    }
    fn f32(&mut self, v: f32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// What one model's megakernel holds on the device; kept for the process.
pub(crate) struct MkState {
    params: CudaSlice<u8>,
    _sync: CudaSlice<i32>,
    _done: CudaSlice<i32>,
    _part_ml: CudaSlice<f32>,
    _part_acc: CudaSlice<f32>,
    plan: MkPlan,
    defines: Vec<String>,
}

/// On when `FERROLM_MEGAKERNEL=1`.
pub(super) fn megakernel_default() -> bool {
    std::env::var("FERROLM_MEGAKERNEL").is_ok_and(|v| v == "1")
}

/// An affine matrix's device buffers and format.
struct AffineParts<'a> {
    words: &'a CudaSlice<u32>,
    scales: &'a DevScales,
    biases: &'a DevScales,
    rows: usize,
    defines: &'a [String],
}

fn affine(m: &CudaMat) -> Option<AffineParts<'_>> {
    match m {
        CudaMat::Affine { words, scales, biases, rows, defines, .. } => {
            Some(AffineParts { words, scales, biases, rows: *rows, defines })
        }
        CudaMat::Dense { .. } => None,
    }
}

/// A layer's matrices in phase order: q, k, v, o, gate, up, down.
fn mats<'a>(l: &LayerWeights<'a, Cuda>) -> [&'a CudaMat; 7] {
    [l.wq, l.wk, l.wv, l.wo, l.w_gate, l.w_up, l.w_down]
}

/// The model's one weight format for every layer matrix, or None (then the op path runs).
/// Every matrix must be affine in the first one's format, of its layer-0 shape, and
/// bulk-copyable (16-byte aligned buffers).
fn one_format<'a>(c: &Cuda, layers: &[LayerWeights<'a, Cuda>], shape: &[(usize, usize); 7]) -> Option<AffineParts<'a>> {
    let first = affine(layers.first()?.wq)?;
    let f32_scales = |s: &DevScales| matches!(s, DevScales::F32(_));
    let ok = layers.iter().all(|l| {
        mats(l).iter().zip(shape).all(|(m, &dims)| {
            affine(m).is_some_and(|p| p.defines == first.defines && f32_scales(p.scales) == f32_scales(first.scales))
                && (m.rows(), m.cols()) == dims
                && ring_aligned(c, m)
        })
    });
    ok.then_some(first)
}

impl Cuda {
    /// Whether one-token decode steps run every layer in the megakernel where it applies.
    pub fn megakernel(&self) -> bool {
        self.megakernel.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Choose the megakernel or the op-by-op layers (tests compare both on one device).
    pub fn set_megakernel(&self, on: bool) {
        // Its ring is fed by sm_90 bulk copies (`clusters`: the same devices).
        self.megakernel.store(on && self.clusters, std::sync::atomic::Ordering::Relaxed);
        self.decode_path_changed();
    }

    /// Megakernel launches so far (queued or captured).
    pub fn megakernel_launches(&self) -> usize {
        self.mega_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `Backend::decode_layers`: Ok(false) where the megakernel is off or does not take
    /// this model (mixed weight formats, dense weights, rows it cannot bulk-copy; said once
    /// on stderr, as the op path then runs).
    pub(super) fn mk_decode_layers(
        &self,
        layers: &[LayerWeights<'_, Cuda>],
        kv: &mut CudaKv,
        rope: &Rope,
        (heads, n_kv): (usize, usize),
        eps: f32,
        bufs: DecodeBufs<'_, Cuda>,
    ) -> Result<bool> {
        if !self.megakernel() || bufs.x.rows != 1 {
            return Ok(false);
        }
        let DecodeBufs { x, q, k, v, att, act } = bufs;
        let acts = [&*x, &*q, &*k, &*v, &*att, &*act];
        let key = self.mk_key(layers, kv, rope, (heads, n_kv), eps, &acts);
        let mut states = self.mega.lock().unwrap_or_else(|e| e.into_inner());
        let st = match states.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                // Built un-captured: a step's first run precedes its capture.
                if self.capturing.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(Error::Invalid(
                        "the decode megakernel's parameters were not set up before the capture".into(),
                    ));
                }
                match self.mk_setup(layers, kv, rope, (heads, n_kv), eps, acts)? {
                    Some(st) => e.insert(st),
                    None => {
                        static SAID: std::sync::Once = std::sync::Once::new();
                        SAID.call_once(|| {
                            eprintln!("ferrolm: FERROLM_MEGAKERNEL: this model's layers are not one ring-copyable affine format; decoding op by op")
                        });
                        return Ok(false);
                    }
                }
            }
        };
        let f = self.function(kernels::file("gemv.cu"), &st.defines, "decode_layers")?;
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, st.plan.smem as i32)
            .map_err(drv("megakernel shared memory"))?;
        let c = LaunchConfig {
            grid_dim: (self.sms as u32, 1, 1),
            block_dim: (32 * gemv_warps() as u32, 1, 1),
            shared_mem_bytes: st.plan.smem as u32,
        };
        let what = format!(
            "decode megakernel launch ({} threads, {} registers each, {} + {} bytes of shared memory of {})",
            c.block_dim.0,
            f.get_attribute(Attr::CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap_or(-1),
            st.plan.smem,
            f.get_attribute(Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).unwrap_or(-1),
            self.smem_optin
        );
        self.launch(&f, c, &[KArg::Ptr(st.params.device_ptr(&self.stream).0)], &what)?;
        self.mega_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(true)
    }

    /// What the parameter block depends on: every buffer address it holds and the scalars.
    fn mk_key(
        &self,
        layers: &[LayerWeights<'_, Cuda>],
        kv: &CudaKv,
        rope: &Rope,
        heads: (usize, usize),
        eps: f32,
        bufs: &[&CudaAct; 6],
    ) -> u64 {
        let mut h = DefaultHasher::new();
        for l in layers {
            for m in mats(l) {
                affine(m).map(|p| p.words.device_ptr(&self.stream).0).hash(&mut h);
            }
            l.attn_norm.device_ptr(&self.stream).0.hash(&mut h);
            l.mlp_norm.device_ptr(&self.stream).0.hash(&mut h);
        }
        for a in bufs {
            act_ptr(self, a).hash(&mut h);
        }
        kv.k.first().map(|b| b.device_ptr(&self.stream).0).hash(&mut h);
        let freqs: Vec<u32> = rope.inv_freq.iter().map(|v| v.to_bits()).collect();
        (freqs, rope.linear.to_bits(), heads, eps.to_bits()).hash(&mut h);
        h.finish()
    }

    /// The megakernel for this model, cache and buffers: None where it does not apply.
    fn mk_setup(
        &self,
        layers: &[LayerWeights<'_, Cuda>],
        kv: &CudaKv,
        rope: &Rope,
        (heads, n_kv): (usize, usize),
        eps: f32,
        bufs: [&CudaAct; 6],
    ) -> Result<Option<MkState>> {
        let [x, q, .., act] = bufs;
        let hd = kv.head_dim;
        let (hidden, ffn) = (x.cols, act.cols);
        let bf16 = |a: &&CudaAct| matches!(a.buf, ActBuf::Bf16(_)) && a.rows == 1;
        if !self.pdl
            || !matches!(x.buf, ActBuf::F32(_))
            || !bufs[1..].iter().all(bf16)
            || ![32, 64, 128, 256].contains(&hd)
            || heads * hd != q.cols
            || n_kv * hd != kv.width
            || !heads.is_multiple_of(n_kv)
        {
            return Ok(None);
        }
        let (qd, kvd) = (heads * hd, kv.width);
        let shape =
            [(qd, hidden), (kvd, hidden), (kvd, hidden), (hidden, qd), (ffn, hidden), (ffn, hidden), (hidden, ffn)];
        let Some(fmt) = one_format(self, layers, &shape) else { return Ok(None) };
        // One x staging for every phase (gemv.cu's XQ is a define of the variant).
        let xq = x_staging(hidden).0;
        let CudaMat::Affine { bits, group, .. } = layers[0].wq else { return Ok(None) };
        if [ffn, qd].iter().any(|&c| x_staging(c).0 != xq) {
            return Ok(None);
        }
        let mut defines = gemv_defines(fmt.defines, xq);
        defines.push("MEGA=1".into());
        let f = self.function(kernels::file("gemv.cu"), &defines, "decode_layers")?;
        let static_smem =
            f.get_attribute(Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).map_err(drv("megakernel attributes"))? as usize;
        let scale_bytes = if matches!(fmt.scales, DevScales::F32(_)) { 4 } else { 2 };
        let shapes = [
            PhaseShape { rows: &[qd, kvd, kvd], cols: hidden, two: false },
            PhaseShape { rows: &[hidden], cols: qd, two: false },
            PhaseShape { rows: &[ffn, ffn], cols: hidden, two: true },
            PhaseShape { rows: &[hidden], cols: ffn, two: false },
        ];
        let room = self.smem_optin.saturating_sub(static_smem);
        let Some(plan) = mk_plan(&shapes, (*bits as usize, *group, scale_bytes), gemv_warps(), xq, room) else {
            return Ok(None);
        };
        self.mk_state(layers, kv, rope, (heads, n_kv, hd), eps, bufs, plan, defines).map(Some)
    }

    /// Allocate the megakernel's scratch and write its parameter block.
    #[allow(clippy::too_many_arguments)]
    fn mk_state(
        &self,
        layers: &[LayerWeights<'_, Cuda>],
        kv: &CudaKv,
        rope: &Rope,
        (heads, n_kv, hd): (usize, usize, usize),
        eps: f32,
        [x, q, k, v, att, act]: [&CudaAct; 6],
        plan: MkPlan,
        defines: Vec<String>,
    ) -> Result<MkState> {
        let alloc_i32 = |n| self.stream.alloc_zeros::<i32>(n).map_err(drv("allocating megakernel scratch"));
        let alloc_f32 = |n| self.stream.alloc_zeros::<f32>(n).map_err(drv("allocating megakernel scratch"));
        let group = heads / n_kv;
        let qb = (1..=4).rev().find(|d| group.is_multiple_of(*d)).unwrap_or(1);
        let max_splits = (self.sms / (heads / qb)).clamp(1, ATTN_SPLITS_MAX);
        let sync = alloc_i32(5 * layers.len() + 1)?;
        let done = alloc_i32(heads)?;
        let part_ml = alloc_f32(2 * heads * max_splits)?;
        let part_acc = alloc_f32(heads * max_splits * hd)?;
        let freqs = self.rope_freqs_for(rope)?;
        let pos = {
            let st = self.staged.lock().unwrap_or_else(|e| e.into_inner());
            let p = st.as_ref().ok_or_else(|| Error::Invalid("decode megakernel without a staged position".into()))?;
            let a = p.pos_dev.device_ptr(&self.stream).0;
            a
        };
        let dp = |s: &CudaSlice<i32>| s.device_ptr(&self.stream).0;
        let fp = |s: &CudaSlice<f32>| s.device_ptr(&self.stream).0;
        let ap = |a: &CudaAct| act_ptr(self, a);
        // The layers go after the 256-byte MkParams slot; the block's own address is known
        // only once allocated, so it is written in two copies: layers first, then params.
        let mut lb = Block::default();
        for (i, l) in layers.iter().enumerate() {
            for m in [l.wq, l.wk, l.wv, l.wo, l.w_gate, l.w_up, l.w_down] {
                let p = affine(m).expect("checked by one_format");
                lb.ptr(p.words.device_ptr(&self.stream).0);
                lb.ptr(scales_ptr(self, p.scales)).ptr(scales_ptr(self, p.biases)).i32(p.rows).i32(0);
            }
            lb.ptr(fp(l.attn_norm)).ptr(fp(l.mlp_norm));
            lb.ptr(kv.k[i].device_ptr(&self.stream).0).ptr(kv.v[i].device_ptr(&self.stream).0);
        }
        debug_assert_eq!(lb.0.len(), 256 * layers.len());
        let mut params =
            self.stream.alloc_zeros::<u8>(256 + lb.0.len()).map_err(drv("allocating megakernel parameters"))?;
        let base = params.device_ptr(&self.stream).0;
        let mut pb = Block::default();
        pb.ptr(base + 256).ptr(ap(x)).ptr(ap(q)).ptr(ap(k)).ptr(ap(v)).ptr(ap(att)).ptr(ap(act));
        pb.ptr(freqs).ptr(fp(&part_ml)).ptr(fp(&part_acc)).ptr(dp(&done)).ptr(pos).ptr(dp(&sync));
        pb.i32(layers.len()).i32(x.cols).i32(act.cols).i32(heads).i32(n_kv).i32(hd).i32(qb).i32(max_splits);
        pb.i32(plan.stages)
            .i32(plan.stage_bytes)
            .i32(plan.x_bytes)
            .i32(usize::from(rope.style == RopeStyle::Interleaved));
        for r in plan.r {
            pb.i32(r);
        }
        pb.f32(eps).f32(rope.linear);
        debug_assert_eq!(pb.0.len(), 176);
        pb.0.resize(256, 0);
        pb.0.extend_from_slice(&lb.0);
        self.stream.memcpy_htod(&pb.0, &mut params).map_err(drv("writing megakernel parameters"))?;
        Ok(MkState {
            params,
            _sync: sync,
            _done: done,
            _part_ml: part_ml,
            _part_acc: part_acc,
            plan,
            defines: defines.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// q/k/v, o, gate/up (the SwiGLU pair) and down phases of `rows` and `cols`.
    fn phases<'a>(rows: [&'a [usize]; 4], cols: [usize; 4]) -> [PhaseShape<'a>; 4] {
        [0, 1, 2, 3].map(|i| PhaseShape { rows: rows[i], cols: cols[i], two: i == 2 })
    }

    fn plan_1b(room: usize) -> Option<MkPlan> {
        let ph = phases([&[2048, 512, 512], &[2048], &[8192, 8192], &[2048]], [2048, 2048, 2048, 8192]);
        mk_plan(&ph, (4, 64, 2), 8, true, room)
    }

    #[test]
    fn megakernel_plan_for_the_1b_shape() {
        // 36 KB steps everywhere: 32 rows of q/k/v and o, 16 of gate and up, 8 of down;
        // 8192-wide x staged in 19 KB; five stages in ~205 KB
        let p = plan_1b(232448 - 22 * 1024).expect("the 1B shape fits");
        assert_eq!(p.r, [4, 4, 2, 1]);
        assert_eq!(p.stage_bytes, 36864);
        assert_eq!(p.x_bytes, 19456);
        assert_eq!(p.stages, 5);
        assert_eq!(p.smem, 19456 + 5 * 36864);
        // too little shared memory for two stages
        assert_eq!(plan_1b(19456 + 36864 + 100), None);
    }

    #[test]
    fn megakernel_plan_refuses_what_it_cannot_copy() {
        // a last step of 3 rows × 2 scales × 2 bytes: not whole 16-byte pieces at any R
        let (a, b): (&[usize], &[usize]) = (&[67], &[128]);
        assert_eq!(mk_plan(&phases([a, b, b, b], [128; 4]), (4, 64, 2), 8, true, 200_000), None);
        // 16-wide rows: 8 bytes of 4-bit weights, not a 16-byte chunk
        assert_eq!(mk_plan(&phases([b; 4], [16; 4]), (4, 16, 2), 8, true, 200_000), None);
    }
}
