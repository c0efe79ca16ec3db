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
    kernel!("kv_quant.cu"),
    kernel!("gemm_wgmma.cu"),
];

pub fn file(name: &str) -> &'static KernelFile {
    FILES.iter().find(|f| f.name == name).expect("kernel file is in FILES")
}

/// Bit widths and groups the CUDA kernels handle (3/5/6-bit weights, whose values cross
/// word boundaries, are widened at load, 3 to 4 bits and 5/6 to 8: tensors.rs).
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

/// -D defines for kv_quant.cu: a quantized KV row format (TURBO 0: affine, its bits in both).
pub fn kv_quant_defines(turbo: bool, key_bits: u32, signed_keys: bool, value_bits: u32) -> Vec<String> {
    vec![
        format!("TURBO={}", u8::from(turbo)),
        format!("KBITS={key_bits}"),
        format!("KSIGNED={}", u8::from(signed_keys)),
        format!("VBITS={value_bits}"),
    ]
}

/// The row formats of the schemes docs/kv.md's speed rows measure (turbo:k8v3, affine:4,
/// affine:8), as `kv_quant_defines`' arguments: CI compiles these at full optimization.
pub const KV_QUANT_MEASURED: [(bool, u32, bool, u32); 3] =
    [(true, 8, true, 3), (false, 4, false, 4), (false, 8, false, 8)];

/// Every row format kv_quant.cu is built for: affine 4 and 8 bits, and TurboQuant's keys
/// (int8, or 5, 4, 2 bits unsigned) by values (2, 3, 4, 5, 8 bits).
pub fn kv_quant_variants() -> Vec<Vec<String>> {
    let affine = crate::kv::scheme::AFFINE_BITS.map(|b| kv_quant_defines(false, b, false, b));
    use crate::kv::turboquant::{KeyFormat, VALUE_BITS};
    let keys = [8, 5, 4, 2].map(|b| KeyFormat::for_bits(b).expect("a TurboQuant key width"));
    let turbo =
        keys.into_iter().flat_map(|k| VALUE_BITS.into_iter().map(move |v| kv_quant_defines(true, k.bits, k.signed, v)));
    affine.into_iter().chain(turbo).collect()
}

/// -D defines for flash_attention.cu over a quantized store of `format`'s rows (head dim `hd`).
pub fn flash_kv_quant_defines(hd: usize, format: &[String]) -> Vec<String> {
    [vec![format!("HD={hd}"), "KVQ=1".into()], format.to_vec()].concat()
}

/// Files compiled only with per-variant defines.
const PER_VARIANT: [&str; 6] =
    ["affine.cu", "gemv.cu", "gemm.cu", "flash_attention.cu", "attention_decode.cu", "kv_quant.cu"];

/// Files of Hopper's architecture-specific instructions (wgmma): built for sm_90a, which
/// runs on sm_90 devices only.
const SM90A_ONLY: [&str; 1] = ["gemm_wgmma.cu"];

/// The architecture `file` is compiled for on a device of `arch`: its own, or sm_90a for
/// the files of sm_90's architecture-specific instructions.
pub fn compile_arch(file: &str, arch: &str) -> String {
    if arch == "sm_90" && SM90A_ONLY.contains(&file) {
        "sm_90a".into()
    } else {
        arch.into()
    }
}

/// Whether a device of `arch` can run `file`'s kernels.
pub fn runs_on(file: &str, arch: &str) -> bool {
    arch == "sm_90" || !SM90A_ONLY.contains(&file)
}

/// `all_variants` that compile for `arch` ("sm_86", "sm_90", …): every variant but the
/// sm_90a files' builds on sm_80 and later (sm_90 features, clusters and PDL, are launch
/// attributes).
pub fn all_variants_for(arch: &str) -> Vec<(&'static KernelFile, Vec<String>)> {
    all_variants().into_iter().filter(|(f, _)| runs_on(f.name, arch)).collect()
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
                // The batched GEMV (gemv.rs `gemv_tokens`) at 8 tokens a block in every
                // format; the default format's at 1, 2 and 4 too, below.
                v.push((
                    file("gemv.cu"),
                    [affine_defines(bits, group, s), vec!["XQ=1".into(), "NT=8".into()]].concat(),
                ));
                v.push((file("gemm.cu"), affine_defines(bits, group, s)));
            }
        }
    }
    for nt in [1, 2, 4] {
        let d = [affine_defines(4, 64, ScaleDtype::BF16), vec!["XQ=1".into(), format!("NT={nt}")]].concat();
        v.push((file("gemv.cu"), d));
    }
    // The traced builds of the decode kernels (`CudaConfig::trace`, trace.rs): one each, so they
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
    for d in kv_quant_variants() {
        for hd in FLASH_HEAD_DIMS {
            v.push((file("flash_attention.cu"), flash_kv_quant_defines(hd, &d)));
        }
        v.push((file("kv_quant.cu"), d));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_is_listed_once() {
        let all = all_variants();
        let mut keys: Vec<String> = all.iter().map(|(f, d)| format!("{}|{}", f.name, d.join(","))).collect();
        keys.sort();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n, "a (file, defines) pair listed twice");
        assert!(all.iter().all(|(f, _)| FILES.iter().any(|g| g.name == f.name)));
    }
}
