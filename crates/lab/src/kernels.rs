//! The lab's kernel sources (crates/lab/kernels/), compiled by the engine's NVRTC wrapper
//! (`Context::function`), which provides the engine's headers (`common.cuh`, …). The lab's
//! own header, mbarrier.cuh, is spliced into the sources that include it, since the
//! engine's wrapper knows only its own headers.
//!
//! `FERROLM_KERNEL_DIR` (the engine's kernel override directory) replaces a file by its
//! name there: a stream_probe.cu placed in it must have mbarrier.cuh's text spliced in
//! already.

use ferrolm::backend::cuda::kernels::KernelFile;
use ferrolm::backend::cuda::nvrtc;
use std::sync::OnceLock;

const MBARRIER: &str = include_str!("../kernels/mbarrier.cuh");
const MBARRIER_INCLUDE: &str = "#include \"mbarrier.cuh\"";
const ATTN_MMA: &str = include_str!("../kernels/attn_mma.cuh");

/// kernels/sync_probe.cu: grid and cluster barriers, and the PDL release pair.
pub fn sync_probe() -> &'static KernelFile {
    static F: KernelFile = KernelFile { name: "sync_probe.cu", src: include_str!("../kernels/sync_probe.cu") };
    &F
}

/// kernels/qgemm_wgmma.cu: the quantized GEMM on warpgroup MMA (compiled for sm_90a).
pub fn qgemm_wgmma() -> &'static KernelFile {
    static F: KernelFile = KernelFile { name: "qgemm_wgmma.cu", src: include_str!("../kernels/qgemm_wgmma.cu") };
    &F
}

/// The engine's gemv.cu with kernels/bgemv.cuh appended: the batched decode GEMV, built
/// from the GEMV's own tiles and sums.
pub fn bgemv() -> &'static KernelFile {
    static F: OnceLock<KernelFile> = OnceLock::new();
    F.get_or_init(|| {
        let gemv = ferrolm::backend::cuda::kernels::file("gemv.cu").src;
        let src = format!("{gemv}\n{}", include_str!("../kernels/bgemv.cuh"));
        KernelFile { name: "bgemv.cu", src: Box::leak(src.into_boxed_str()) }
    })
}

/// kernels/bgemv_mma.cu: the decode GEMV's arithmetic on integer MMAs (4-bit weights).
pub fn bgemv_mma() -> &'static KernelFile {
    static F: KernelFile = KernelFile { name: "bgemv_mma.cu", src: include_str!("../kernels/bgemv_mma.cu") };
    &F
}

/// The engine's attention_decode.cuh with kernels/attn_mma.cuh spliced in: the decode
/// attention over the bf16 cache on the tensor cores in the builds of 2-4 query heads a
/// block (`FERROLM_ATTN_QB=4`). As a `FERROLM_KERNEL_DIR` file: `kernel_dir attn-mma DIR`.
pub fn attn_mma_header() -> &'static str {
    static S: OnceLock<String> = OnceLock::new();
    S.get_or_init(|| {
        let (_, engine) =
            nvrtc::HEADERS.iter().find(|(n, _)| *n == "attention_decode.cuh").expect("the engine's header");
        let attend = "template <class Wait>\n__device__ __forceinline__ void attend(";
        let first_loads = "    if (first < pc) load_kv(first, kr, vr);";
        let rope_q = "            rope.apply(qv[j], G, interleaved);\n";
        let main_loop = "    for (int base0 = first; base0 < pc; base0 += AW * PW * UNR) {";
        let merge = "    const float *pm = s_pm, *pl = s_pl, *po = s_po;";
        replace_each(
            engine,
            &[
                (attend, format!("{ATTN_MMA}\n{attend}")),
                (first_loads, "    if (!ATT_MMA_ON && first < pc) load_kv(first, kr, vr);".into()),
                (rope_q, format!("{rope_q}            ATT_MMA_Q(j);\n")),
                (main_loop, format!("    if (ATT_MMA_ON) {{\n        ATT_MMA_BODY;\n    }} else {{\n{main_loop}")),
                (merge, format!("    }}\n{merge}")),
            ],
        )
    })
}

/// The engine's attention_decode.cu with its blocks-per-SM bound at `blocks` instead of 3
/// (the tensor-core loop at head dim 128 spills under the bound of 3: 168 registers; 206
/// under 2, none).
pub fn attn_mma_kernel(blocks: u32) -> String {
    let src = ferrolm::backend::cuda::kernels::file("attention_decode.cu").src;
    replace_each(src, &[("__launch_bounds__(128, 3)", format!("__launch_bounds__(128, {blocks})"))])
}

/// `attention_decode.cu` (the engine's, or `attn_mma_kernel`'s) with `attn_mma_header()`
/// in place of its include, as one source for NVRTC.
fn over_attn_mma_header(cu: &str) -> String {
    replace_each(cu, &[("#include \"attention_decode.cuh\"", attn_mma_header().to_string())])
}

/// The engine's attention_decode.cu over `attn_mma_header()`.
pub fn attn_mma() -> &'static KernelFile {
    static F: OnceLock<KernelFile> = OnceLock::new();
    F.get_or_init(|| {
        let src = over_attn_mma_header(ferrolm::backend::cuda::kernels::file("attention_decode.cu").src);
        KernelFile { name: "attn_mma.cu", src: Box::leak(src.into_boxed_str()) }
    })
}

/// `src` with each (anchor, text) pair's anchor, which must occur exactly once, replaced.
fn replace_each(src: &str, pairs: &[(&str, String)]) -> String {
    let mut out = src.to_string();
    for (anchor, text) in pairs {
        assert_eq!(out.matches(anchor).count(), 1, "the anchor {anchor:?} occurs once");
        out = out.replacen(anchor, text, 1);
    }
    out
}

/// kernels/stream_probe.cu with mbarrier.cuh spliced in.
pub fn stream_probe() -> &'static KernelFile {
    static F: OnceLock<KernelFile> = OnceLock::new();
    F.get_or_init(|| KernelFile {
        name: "stream_probe.cu",
        src: Box::leak(splice(include_str!("../kernels/stream_probe.cu")).into_boxed_str()),
    })
}

/// `src` with its `#include "mbarrier.cuh"` line replaced by the header's text.
fn splice(src: &str) -> String {
    replace_each(src, &[(MBARRIER_INCLUDE, MBARRIER.to_string())])
}

/// Every kernel file of the lab.
pub fn all() -> [&'static KernelFile; 2] {
    [sync_probe(), stream_probe()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm::backend::cuda::nvrtc;

    /// What a kernel includes: the names in its `#include "…"` lines.
    fn includes(src: &str) -> Vec<&str> {
        src.lines().filter_map(|l| l.trim().strip_prefix("#include \"")?.strip_suffix('"')).collect()
    }

    /// NVRTC's quick pass over `src` for `arch` must give a CUBIN (`what` names it in a failure).
    fn assert_cubin(what: &str, name: &str, src: &str, arch: &str, defines: &[String]) {
        let bin = nvrtc::compile_with(name, src, arch, defines, &["--Ofast-compile=max"])
            .unwrap_or_else(|e| panic!("{what} {defines:?}: {e}"));
        assert_eq!(&bin[..4], b"\x7fELF", "{what} {defines:?}: not a CUBIN");
    }

    /// The defines `file` is compiled with for each weight format (and, for gemv.cu, x form).
    fn formats(file: &str) -> Vec<Vec<String>> {
        let variants = ferrolm::backend::cuda::kernels::all_variants();
        variants.into_iter().filter(|(v, _)| v.name == file).map(|(_, d)| d).collect()
    }

    #[test]
    fn every_include_left_is_an_engine_header() {
        for f in all().into_iter().chain([qgemm_wgmma(), bgemv_mma()]) {
            for name in includes(f.src) {
                assert!(
                    nvrtc::HEADERS.iter().any(|(h, _)| *h == name),
                    "{} includes {name}, which the engine's NVRTC wrapper does not provide",
                    f.name
                );
            }
        }
        assert!(stream_probe().src.contains("mbar_wait"), "mbarrier.cuh spliced in");
    }

    /// The batched GEMV compiles at eight tokens a block in every weight format gemv.cu is
    /// compiled in with int16 x (the XQ=1 variants; the text is empty without) that `pick`
    /// takes, and at one in the first (each compile is all of gemv.cu: CI's time, so the
    /// formats are split over two tests that run side by side).
    fn batched_gemv_compiles(pick: impl Fn(&[String]) -> bool) {
        if !nvrtc::available() {
            eprintln!("SKIPPED: libnvrtc not found (source scripts/nvrtc-env.sh)");
            return;
        }
        let f = bgemv();
        assert!(f.src.contains("BGEMV_KERNEL(4)"), "the lab text is appended");
        let formats: Vec<_> =
            formats("gemv.cu").into_iter().filter(|d| d.iter().any(|d| d == "XQ=1") && pick(d)).collect();
        assert!(formats.len() >= 3, "gemv.cu's int16-x formats taken: {}", formats.len());
        for (i, d) in formats.iter().enumerate() {
            for nt in if i == 0 { vec![1, 8] } else { vec![8] } {
                assert_cubin("bgemv", f.name, f.src, "sm_90", &[d.clone(), vec![format!("BG_NT={nt}")]].concat());
            }
        }
    }

    #[test]
    fn the_batched_gemv_compiles_for_every_4_bit_format() {
        batched_gemv_compiles(|d| d.iter().any(|d| d == "BITS=4"));
    }

    #[test]
    fn the_batched_gemv_compiles_for_every_other_width() {
        batched_gemv_compiles(|d| !d.iter().any(|d| d == "BITS=4"));
    }

    /// The integer-MMA batched GEMV compiles for every 4-bit format (groups of 32 or more)
    /// at each of its token-tile counts.
    #[test]
    fn the_integer_mma_gemv_compiles_for_every_4_bit_format() {
        if !nvrtc::available() {
            eprintln!("SKIPPED: libnvrtc not found (source scripts/nvrtc-env.sh)");
            return;
        }
        let f = bgemv_mma();
        let formats: Vec<_> = formats("gemm.cu")
            .into_iter()
            .filter(|d| {
                let group = d.iter().find_map(|d| d.strip_prefix("GROUP=")).and_then(|g| g.parse::<usize>().ok());
                d.iter().any(|d| d == "BITS=4") && group.is_some_and(|g| g % 32 == 0)
            })
            .collect();
        assert!(formats.len() >= 3, "4-bit formats: {}", formats.len());
        for d in &formats {
            for tt in [1, 2, 4] {
                assert_cubin("bgemv_mma", f.name, f.src, "sm_90", &[d.clone(), vec![format!("TT={tt}")]].concat());
            }
        }
    }

    /// The bf16 decode attention with the tensor-core loop spliced in compiles in every build
    /// the host asks for (1-4 query heads a block, deep caches' scoring, the register cap).
    #[test]
    fn the_tensor_core_decode_attention_compiles_in_every_build() {
        if !nvrtc::available() {
            eprintln!("SKIPPED: libnvrtc not found (source scripts/nvrtc-env.sh)");
            return;
        }
        let f = attn_mma();
        assert!(f.src.contains("attend_mma_bf16(kc, vc") && f.src.contains("ATT_MMA_Q(j);"), "spliced");
        use ferrolm::backend::cuda::kernels::attention_decode_defines;
        for qb in 1..=4 {
            for (deep, capped) in [(false, false), (true, false), (true, true)] {
                assert_cubin(f.name, f.name, f.src, "sm_90", &attention_decode_defines(qb, deep, capped));
            }
        }
        // Two blocks an SM; both phases' loads at a step's start, or the values a step ahead.
        let two = over_attn_mma_header(&attn_mma_kernel(2));
        assert!(two.contains("__launch_bounds__(128, 2)"));
        assert_cubin("attn_mma, 2 blocks", f.name, &two, "sm_90", &attention_decode_defines(4, true, false));
        for (mode, what) in [(0, "eager loads"), (2, "values a step ahead")] {
            let src = format!("#define ATT_MMA_SPLIT_LOADS {mode}\n{two}");
            assert_cubin(what, f.name, &src, "sm_90", &attention_decode_defines(4, true, false));
        }
    }

    /// The wgmma GEMM compiles for sm_90a in every weight format gemm.cu is compiled in
    /// (the first format also with its ring at three stages, the fewest it allows).
    #[test]
    fn the_wgmma_gemm_compiles_for_every_weight_format() {
        if !nvrtc::available() {
            eprintln!("SKIPPED: libnvrtc not found (source scripts/nvrtc-env.sh)");
            return;
        }
        let f = qgemm_wgmma();
        let formats = formats("gemm.cu");
        assert!(formats.len() >= 9, "gemm.cu's formats");
        for (i, d) in formats.iter().enumerate() {
            let stages = if i == 0 { "STAGES=3" } else { "STAGES=4" };
            assert_cubin("qgemm_wgmma", f.name, f.src, "sm_90a", &[d.clone(), vec![stages.to_string()]].concat());
        }
    }

    /// The probes' kernels compile against today's engine headers (NVRTC's quick pass, as
    /// the engine's kernels_compile test does for most variants). Skipped, and said so,
    /// where NVRTC cannot be loaded (scripts/nvrtc-env.sh puts it on LD_LIBRARY_PATH).
    #[test]
    fn the_probe_kernels_compile_for_sm90() {
        if !nvrtc::available() {
            eprintln!("SKIPPED: libnvrtc not found (source scripts/nvrtc-env.sh)");
            return;
        }
        for f in all() {
            assert_cubin(f.name, f.name, f.src, "sm_90", &[]);
        }
    }
}
