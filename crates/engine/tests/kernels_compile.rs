//! Every CUDA kernel variant compiles with NVRTC for sm_90 (Hopper) to a real CUBIN, and
//! those an older GPU is given compile for sm_86 (Ampere) too. Runs on
//! machines without a GPU: only the NVRTC library is needed (CI installs
//! `nvidia-cuda-nvrtc` from PyPI and puts its lib directory on LD_LIBRARY_PATH). Fails,
//! never skips, when NVRTC is missing.

use ferrolm::backend::cuda::{kernels, nvrtc};

/// Whether CI compiles a variant as the backend does (full optimization) or with NVRTC's
/// `--Ofast-compile=max`: the same front end, template instantiation and PTX assembly to a
/// real sm_90 CUBIN (so any kernel that does not compile still fails), with less
/// optimization. All of gemv.cu at full optimization was 20 of CI's 25 minutes of compiling
/// (12–22 s a variant against 3–4 s quick, 2 cores), and gemm.cu with its few-token and
/// wide forms takes 6–8 s a variant against ~1 s quick, so the full pass keeps what the
/// measured paths run: every other file in every format (each ~1 s); gemv.cu in the default
/// format of `convert --quantize 4` and the synthetic models (4-bit, group 64, bf16
/// scales), both x stagings; gemm.cu in that format and in the Q4_0 GGUFs' (4-bit, group
/// 32, f16 scales). The other formats of both and gemv.cu's knob-only variants (ring,
/// megakernel, split-K, fused layer end, attention block, warps, trace) compile quickly, as
/// do flash_attention.cu's builds over quantized KV rows but the default scheme's
/// (turbo:k8v3) and kv_quant.cu's (~3 s a variant) but the measured schemes' (turbo:k8v3,
/// affine:4, affine:8).
fn full_optimization(file: &str, defines: &[String]) -> bool {
    let format = |f: [&str; 3]| defines.len() >= 3 && defines[..3].iter().zip(f).all(|(d, f)| d == f);
    let default_format = ["BITS=4", "GROUP=64", "SCALE_T=1"];
    match file {
        "gemv.cu" => defines.len() == 4 && format(default_format) && defines[3].starts_with("XQ="),
        "gemm.cu" => format(default_format) || format(["BITS=4", "GROUP=32", "SCALE_T=0"]),
        "flash_attention.cu" if defines.iter().any(|d| d == "KVQ=1") => {
            defines.ends_with(&kernels::kv_quant_defines(true, 8, true, 3))
        }
        "kv_quant.cu" => kernels::KV_QUANT_MEASURED
            .into_iter()
            .any(|(turbo, k, signed, v)| defines == kernels::kv_quant_defines(turbo, k, signed, v)),
        _ => true,
    }
}

#[test]
fn every_kernel_variant_compiles_for_sm90() {
    assert!(nvrtc::available(), "libnvrtc not found: pip install nvidia-cuda-nvrtc and set LD_LIBRARY_PATH");
    let variants = kernels::all_variants();
    assert!(variants.len() >= 40, "{} variants", variants.len());
    let full = variants.iter().filter(|(f, d)| full_optimization(f.name, d)).count();
    // The default format's two gemv.cu variants, two of gemm.cu's and every other file's
    // variants (affine.cu's 36 formats among them).
    assert!(full >= 2 + 2 + 36, "{full} variants at full optimization");
    // NVRTC is thread-safe: compile on every core (CI's wall time is mostly this), one
    // variant per rayon task, so an idle core takes the next one: the variants' costs
    // differ by 10× and more, and contiguous halves left one of two cores idle at the end.
    use rayon::prelude::*;
    variants.par_iter().with_max_len(1).for_each(|(f, defines)| {
        let opts: &[&str] = if full_optimization(f.name, defines) { &[] } else { &["--Ofast-compile=max"] };
        let bin = nvrtc::compile_with(f.name, f.src, &kernels::compile_arch(f.name, "sm_90"), defines, opts)
            .unwrap_or_else(|e| panic!("{} {defines:?} {opts:?}: {e}", f.name));
        assert_eq!(&bin[..4], b"\x7fELF", "{} {defines:?}: not a CUBIN", f.name);
    });
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    let e = nvrtc::compile("broken.cu", "extern \"C\" __global__ void k() { int x = ; }", "sm_90", &[]).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("broken.cu") && msg.contains("sm_90") && msg.contains("error"), "{msg}");
}

#[test]
fn the_quick_pass_still_assembles_to_sass() {
    // Invalid inline PTX passes the C++ front end and fails only in the PTX assembler:
    // the quick pass must still run it.
    let src = "extern \"C\" __global__ void k() { asm volatile(\"not.an.instruction;\"); }";
    for opts in [&[][..], &["--Ofast-compile=max"][..]] {
        let e = nvrtc::compile_with("bad_ptx.cu", src, "sm_90", &[], opts).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("bad_ptx.cu") && msg.contains("ptxas"), "{opts:?}: {msg}");
    }
}

/// Older GPUs (sm_80–sm_89) compile every variant `all_variants_for` gives them, so
/// `ferrolm kernels` works on such a device. The default weight format's variants and the
/// format-free files, quick pass (the sm_90 test above covers the full optimization).
#[test]
fn older_gpus_compile_what_they_are_given() {
    assert!(nvrtc::available(), "libnvrtc not found: pip install nvidia-cuda-nvrtc and set LD_LIBRARY_PATH");
    let default_format = ["BITS=4", "GROUP=64", "SCALE_T=1"];
    let in_default_format = |d: &[String]| {
        !d.iter().any(|x| x.starts_with("BITS=")) || d[..3].iter().zip(default_format).all(|(a, b)| a == b)
    };
    use rayon::prelude::*;
    let kept = kernels::all_variants_for("sm_86");
    let tried: Vec<_> = kept.iter().filter(|(_, d)| in_default_format(d)).collect();
    assert!(tried.len() >= 20, "{} variants", tried.len());
    tried.par_iter().with_max_len(1).for_each(|(f, d)| {
        nvrtc::compile_with(f.name, f.src, "sm_86", d, &["--Ofast-compile=max"])
            .unwrap_or_else(|e| panic!("{} {d:?} for sm_86: {e}", f.name));
    });
}
