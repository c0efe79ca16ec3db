//! The kernel sources (one op per file under crates/engine/kernels/) and every variant the
//! CUDA backend compiles: affine.cu is specialized per (bits, group, scale dtype).

use crate::quant::ScaleDtype;

pub struct KernelFile {
    pub name: &'static str,
    pub src: &'static str,
}

macro_rules! kernel {
    ($n:literal) => {
        KernelFile { name: $n, src: include_str!(concat!("../../../kernels/", $n)) }
    };
}

pub const FILES: &[KernelFile] = &[
    kernel!("rmsnorm.cu"),
    kernel!("elementwise.cu"),
    kernel!("rope.cu"),
    kernel!("affine.cu"),
    kernel!("gemv.cu"),
    kernel!("dense.cu"),
    kernel!("attention.cu"),
    kernel!("attention_decode.cu"),
    kernel!("sample.cu"),
    kernel!("gemm.cu"),
    kernel!("flash_attention.cu"),
    kernel!("sync_probe.cu"),
    kernel!("stream_probe.cu"),
];

pub fn file(name: &str) -> &'static KernelFile {
    FILES.iter().find(|f| f.name == name).expect("kernel file is in FILES")
}

/// Bit widths and groups the CUDA kernels handle (3/5/6-bit weights, whose values cross
/// word boundaries, are widened to 8 bits at load: device.rs).
pub const AFFINE_BITS: [u32; 3] = [2, 4, 8];
pub const AFFINE_GROUPS: [usize; 4] = [16, 32, 64, 128];

/// Head dims flash_attention.cu is compiled for (-D HD=…).
pub const FLASH_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// -D defines for an affine.cu (and gemm.cu) specialization.
pub fn affine_defines(bits: u32, group: usize, scale: ScaleDtype) -> Vec<String> {
    let s = match scale {
        ScaleDtype::F16 => 0,
        ScaleDtype::BF16 => 1,
        ScaleDtype::F32 => 2,
    };
    vec![format!("BITS={bits}"), format!("GROUP={group}"), format!("SCALE_T={s}")]
}

/// -D defines for attention_decode.cu: registers for `qb` query heads per block (QB_MAX),
/// the deep-cache scoring (SCORE_BATCH) and, for one head per block, the register-capped
/// kernel (ATT_CAP). attn_decode.rs launches with these, and `all_variants` precompiles
/// them, so the two must agree.
pub fn attention_decode_defines(qb: usize, deep: bool, capped: bool) -> Vec<String> {
    let mut d = vec![format!("QB_MAX={qb}"), format!("SCORE_BATCH={}", u8::from(deep))];
    if capped && qb == 1 {
        d.push("ATT_CAP=1".into());
    }
    d
}

/// Decode attention over caches of more positions than this scores a round's positions
/// together (SCORE_BATCH): faster at 8K cached, slower at 512 (attn_decode.rs).
pub const ATTN_DEEP_POSITIONS: usize = 8 * 128;

/// gemv.cu's defines for the attention block (attention_block.cuh; attn_block.rs) of a
/// weight format (`format`: bits, group, scale dtype), its x staging (XQ), the GQA group
/// (`qc` query heads per cluster), the cache depth and the q/k/v rows per warp (`r`):
/// 4 warps (attend()'s), clusters of up to 16.
pub fn attention_block_defines(format: &[String], xq: bool, qc: usize, deep: bool, r: usize) -> Vec<String> {
    let mut d = format.to_vec();
    d.extend([format!("XQ={}", u8::from(xq)), "NW=4".into(), "ATTN_BLOCK=1".into(), format!("QKV_R={r}")]);
    d.push("CS_MAX=16".into());
    d.extend(attention_decode_defines(qc, deep, false));
    d
}

/// Files compiled only with per-variant defines.
const PER_VARIANT: [&str; 5] = ["affine.cu", "gemv.cu", "gemm.cu", "flash_attention.cu", "attention_decode.cu"];

/// Whether a variant is built on sm_90 instructions (bulk copies with `expect_tx`, cluster
/// registers): the ring-fed GEMVs, the megakernel and the split-K MLP. The backend never
/// picks them on older devices (device.rs), and `ferrolm kernels` skips them there.
pub fn needs_sm90(defines: &[String]) -> bool {
    defines.iter().any(|d| matches!(d.as_str(), "RING=1" | "MEGA=1" | "SPLITK=1"))
}

/// `all_variants` that compile for `arch` ("sm_86", "sm_90", …): all of them from sm_90 on,
/// without the `needs_sm90` ones before.
pub fn all_variants_for(arch: &str) -> Vec<(&'static KernelFile, Vec<String>)> {
    let sm90 = arch
        .strip_prefix("sm_")
        .and_then(|n| n.trim_end_matches(char::is_alphabetic).parse::<u32>().ok())
        .is_some_and(|n| n >= 90);
    all_variants().into_iter().filter(|(_, d)| sm90 || !needs_sm90(d)).collect()
}

/// Every (file, defines) the backend may compile: what CI compiles with NVRTC.
pub fn all_variants() -> Vec<(&'static KernelFile, Vec<String>)> {
    let mut v: Vec<(&'static KernelFile, Vec<String>)> =
        FILES.iter().filter(|f| !PER_VARIANT.contains(&f.name)).map(|f| (f, vec![])).collect();
    for bits in AFFINE_BITS {
        for group in AFFINE_GROUPS {
            for s in [ScaleDtype::F16, ScaleDtype::BF16, ScaleDtype::F32] {
                v.push((file("affine.cu"), affine_defines(bits, group, s)));
                for xq in ["XQ=0", "XQ=1"] {
                    let mut d = affine_defines(bits, group, s);
                    d.push(xq.into());
                    v.push((file("gemv.cu"), d));
                }
                v.push((file("gemm.cu"), affine_defines(bits, group, s)));
            }
        }
    }
    // The fused layer end (FFN=1, ffn.rs; compiled on demand per weight format and rows per
    // warp): one variant, with the o phase, the 1B shape's (down over two K slices), so it
    // compiles.
    let mut ffn = affine_defines(4, 64, ScaleDtype::BF16);
    ffn.extend(["XQ=1", "FFN=1", "FFN_RO=4", "FFN_RU=4", "FFN_RD=2", "FFN_KO=1", "FFN_KD=2"].map(String::from));
    v.push((file("gemv.cu"), ffn));
    // The ring-fed GEMVs (RING=1, gemv_ring.cuh; FERROLM_GEMV_RING): one variant, so they
    // compile.
    let mut ring = affine_defines(4, 64, ScaleDtype::BF16);
    ring.extend(["XQ=1", "RING=1"].map(String::from));
    v.push((file("gemv.cu"), ring));
    // The decode megakernel (MEGA=1, decode_layers.cuh; FERROLM_MEGAKERNEL): one variant,
    // so it compiles.
    let mut mega = affine_defines(4, 64, ScaleDtype::BF16);
    mega.extend(["XQ=1", "MEGA=1"].map(String::from));
    v.push((file("gemv.cu"), mega));
    // The split-K MLP (SPLITK=1, ffn_splitk.cuh; FERROLM_FFN_FUSED=3): one variant, so it
    // compiles.
    let mut splitk = affine_defines(4, 64, ScaleDtype::BF16);
    splitk.extend(["XQ=1", "SPLITK=1", "SPLITK_R=4"].map(String::from));
    v.push((file("gemv.cu"), splitk));
    // The attention block (ATTN_BLOCK=1, attention_block.cuh; FERROLM_ATTN_BLOCK) as the
    // models we measure run it (query heads per cluster and q/k/v rows per warp: SmolLM2
    // 1 and 2, Llama 3 2 and 4), short and deep caches.
    for (qc, r) in [(1, 2), (2, 4)] {
        for deep in [false, true] {
            let fmt = affine_defines(4, 64, ScaleDtype::BF16);
            v.push((file("gemv.cu"), attention_block_defines(&fmt, true, qc, deep, r)));
        }
    }
    // The 4- and 16-warp GEMVs (FERROLM_GEMV_WARPS, a tuning knob): one variant each, so
    // they compile.
    for nw in ["NW=4", "NW=16"] {
        let mut d = affine_defines(4, 64, ScaleDtype::BF16);
        d.extend(["XQ=1".into(), nw.into()]);
        v.push((file("gemv.cu"), d));
    }
    // The traced builds of the decode kernels (FERROLM_TRACE, trace.rs): one each, so they
    // compile.
    let fmt = affine_defines(4, 64, ScaleDtype::BF16);
    let gemv = [fmt.clone(), vec!["XQ=1".into()]].concat();
    let attn = attention_decode_defines(1, false, false);
    for (f, d) in [("gemv.cu", gemv), ("affine.cu", fmt), ("attention_decode.cu", attn), ("sample.cu", vec![])] {
        v.push((file(f), [d, vec!["TRACE=1".into()]].concat()));
    }
    // Decode attention per query heads per block (QB_MAX: 1, or a divisor of the GQA group
    // up to 4), short- and deep-cache forms (attn_decode.rs).
    for qb in 1..=4 {
        for deep in [false, true] {
            v.push((file("attention_decode.cu"), attention_decode_defines(qb, deep, false)));
        }
    }
    v.push((file("attention_decode.cu"), attention_decode_defines(1, true, true)));
    for hd in FLASH_HEAD_DIMS {
        v.push((file("flash_attention.cu"), vec![format!("HD={hd}")]));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_arches_get_every_variant_but_the_sm90_ones() {
        let all = all_variants();
        for arch in ["sm_90", "sm_90a", "sm_100", "sm_120"] {
            assert_eq!(all_variants_for(arch).len(), all.len(), "{arch}");
        }
        let older = all_variants_for("sm_86");
        let dropped: Vec<_> = all.iter().filter(|(_, d)| needs_sm90(d)).collect();
        // The ring-fed GEMVs, the megakernel and the split-K MLP: one variant each.
        assert_eq!(dropped.len(), 3, "{:?}", dropped.iter().map(|(_, d)| d).collect::<Vec<_>>());
        assert_eq!(older.len() + dropped.len(), all.len());
        assert!(older.iter().all(|(_, d)| !needs_sm90(d)));
        assert_eq!(all_variants_for("sm_80").len(), older.len());
    }
}
