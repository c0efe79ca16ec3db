//! Every CUDA kernel variant compiles with NVRTC for sm_90 (Hopper) to a real CUBIN. Runs on
//! machines without a GPU: only the NVRTC library is needed (CI installs
//! `nvidia-cuda-nvrtc` from PyPI and puts its lib directory on LD_LIBRARY_PATH). Fails,
//! never skips, when NVRTC is missing.

use ferrolm::backend::cuda::{kernels, nvrtc};

#[test]
fn every_kernel_variant_compiles_for_sm90() {
    assert!(nvrtc::available(), "libnvrtc not found: pip install nvidia-cuda-nvrtc and set LD_LIBRARY_PATH");
    let variants = kernels::all_variants();
    assert!(variants.len() >= 40, "{} variants", variants.len());
    // NVRTC is thread-safe: compile on every core (CI's wall time is mostly this), one
    // variant per rayon task, so an idle core takes the next one: the variants' costs
    // differ by 10× and more, and contiguous halves left one of two cores idle at the end
    // (2 cores: 11 min 54 s against 10 min 7 s for one variant at a time, for 20 minutes
    // of compiling).
    use rayon::prelude::*;
    variants.par_iter().with_max_len(1).for_each(|(f, defines)| {
        let bin = nvrtc::compile(f.name, f.src, "sm_90", defines).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&bin[..4], b"\x7fELF", "{} {defines:?}: not a CUBIN", f.name);
    });
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    let e = nvrtc::compile("broken.cu", "extern \"C\" __global__ void k() { int x = ; }", "sm_90", &[]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("broken.cu") && msg.contains("sm_90") && msg.contains("error"), "{msg}");
}
