//! The lab's kernel sources (crates/lab/kernels/), compiled by the engine's NVRTC wrapper
//! (`Context::function`), which provides the engine's headers (`common.cuh`, …). The lab's
//! own header, mbarrier.cuh, is spliced into the sources that include it, since the
//! engine's wrapper knows only its own headers.
//!
//! `FERROLM_KERNEL_DIR` (the engine's kernel override directory) replaces a file by its
//! name there: a stream_probe.cu placed in it must have mbarrier.cuh's text spliced in
//! already.

use ferrolm::backend::cuda::kernels::KernelFile;
use std::sync::OnceLock;

const MBARRIER: &str = include_str!("../kernels/mbarrier.cuh");
const MBARRIER_INCLUDE: &str = "#include \"mbarrier.cuh\"";

/// kernels/sync_probe.cu: grid and cluster barriers, and the PDL release pair.
pub fn sync_probe() -> &'static KernelFile {
    static F: KernelFile = KernelFile { name: "sync_probe.cu", src: include_str!("../kernels/sync_probe.cu") };
    &F
}

/// kernels/qgemm_wgmma.cu: the quantized GEMM on warpgroup MMA (compiled for sm_90a), every
/// thread loading, dequantizing and multiplying, and its dense form over a dequantized
/// bf16 copy.
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
    assert_eq!(src.matches(MBARRIER_INCLUDE).count(), 1, "one {MBARRIER_INCLUDE:?} line");
    src.replacen(MBARRIER_INCLUDE, MBARRIER, 1)
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
        assert!(stream_probe().src.contains("mbar_wait"), "mbarrier.cuh spliced into stream_probe.cu");
    }

    /// The batched GEMV compiles at eight tokens a block in the weight formats gemv.cu is
    /// compiled in with int16 x (the XQ=1 variants; the text is empty without) that `pick`
    /// takes, and at one in the first (each compile is all of gemv.cu, ~8 s).
    fn batched_gemv_compiles(pick: impl Fn(&[String]) -> bool) {
        if !nvrtc::available() {
            eprintln!("SKIPPED: libnvrtc not found (source scripts/nvrtc-env.sh)");
            return;
        }
        let f = bgemv();
        assert!(f.src.contains("BGEMV_KERNEL(4)"), "the lab text is appended");
        let formats: Vec<_> =
            formats("gemv.cu").into_iter().filter(|d| d.iter().any(|d| d == "XQ=1") && pick(d)).collect();
        assert!(!formats.is_empty(), "no gemv.cu int16-x format taken");
        for (i, d) in formats.iter().enumerate() {
            for nt in if i == 0 { vec![1, 8] } else { vec![8] } {
                assert_cubin("bgemv", f.name, f.src, "sm_90", &[d.clone(), vec![format!("BG_NT={nt}")]].concat());
            }
        }
    }

    /// Formats in which every bit width, group size and scale dtype gemv.cu is compiled in
    /// appears at least once, the default format (4-bit, group 64, bf16 scales) among them: the
    /// lab kernel's own text is the same in every format, what differs is the engine's
    /// dequantization, which kernels_compile covers in every format.
    fn covering(d: &[String]) -> bool {
        let format = |(b, g, s): (u32, usize, u32)| [format!("BITS={b}"), format!("GROUP={g}"), format!("SCALE_T={s}")];
        [(4, 64, 1), (2, 16, 0), (8, 32, 2), (4, 128, 0)].into_iter().any(|f| d.starts_with(&format(f)))
    }

    #[test]
    fn the_batched_gemv_compiles_in_a_covering_set_of_formats() {
        let all = formats("gemv.cu");
        let taken: Vec<_> = all.iter().filter(|d| d.iter().any(|x| x == "XQ=1") && covering(d)).collect();
        for key in ["BITS=", "GROUP=", "SCALE_T="] {
            let values = |ds: &mut dyn Iterator<Item = &Vec<String>>| -> std::collections::BTreeSet<String> {
                ds.flat_map(|d| d.iter().filter(|x| x.starts_with(key)).cloned()).collect()
            };
            assert_eq!(values(&mut taken.iter().copied()), values(&mut all.iter()), "{key} values not all covered");
        }
        batched_gemv_compiles(covering);
    }

    /// Every format (~40 compiles, ~5 minutes of one core): run when bgemv.cuh changes,
    /// `cargo test -p ferrolm-lab -- --ignored batched_gemv`.
    #[test]
    #[ignore = "every format: minutes; the covering set runs by default"]
    fn the_batched_gemv_compiles_for_every_format() {
        batched_gemv_compiles(|_| true);
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

    /// The wgmma GEMM compiles for sm_90a in every weight format gemm.cu is compiled in
    /// (the first format with its ring at three stages, the fewest it allows, the others at
    /// four, as `timings wgmma` runs it).
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
