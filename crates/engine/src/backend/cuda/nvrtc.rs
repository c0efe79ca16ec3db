//! Run-time kernel compilation: NVRTC compiles `.cu` sources to a CUBIN (real SASS for the
//! device's own architecture, e.g. sm_90, never PTX for an older one), cached on disk under
//! `$FERROLM_HOME/kernels/<hash>.cubin` keyed by source + headers + options + arch, so the
//! second start compiles nothing. cudarc's safe NVRTC wrapper stops at PTX, so the program
//! lifecycle is driven through its raw bindings here.

use super::kernels::compile_arch;
use crate::{Error, Result};
use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// Headers every kernel may `#include "name"`.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("affine.cuh", include_str!("../../../kernels/affine.cuh")),
    ("mma.cuh", include_str!("../../../kernels/mma.cuh")),
    ("qgemm.cuh", include_str!("../../../kernels/qgemm.cuh")),
    ("gemm_small.cuh", include_str!("../../../kernels/gemm_small.cuh")),
    ("trace.cuh", include_str!("../../../kernels/trace.cuh")),
    ("attention_decode.cuh", include_str!("../../../kernels/attention_decode.cuh")),
    ("attention_decode_mma.cuh", include_str!("../../../kernels/attention_decode_mma.cuh")),
    ("x_staged.cuh", include_str!("../../../kernels/x_staged.cuh")),
    ("wgmma.cuh", include_str!("../../../kernels/wgmma.cuh")),
    ("kv_encode.cuh", include_str!("../../../kernels/kv_encode.cuh")),
    ("kv_quant_mma.cuh", include_str!("../../../kernels/kv_quant_mma.cuh")),
    ("argmax.cuh", include_str!("../../../kernels/argmax.cuh")),
    ("x_stage.cuh", include_str!("../../../kernels/x_stage.cuh")),
];

/// The text of kernel file or header `name`: the override directory's copy when there is
/// one, else the built-in text.
pub fn source(name: &str, builtin: &'static str) -> std::borrow::Cow<'static, str> {
    match crate::env::kernel_dir().and_then(|d| std::fs::read_to_string(d.join(name)).ok()) {
        Some(s) => s.into(),
        None => builtin.into(),
    }
}

fn headers() -> Vec<(&'static str, std::borrow::Cow<'static, str>)> {
    HEADERS.iter().map(|(n, s)| (*n, source(n, s))).collect()
}

/// Is the NVRTC library loadable (dynamic loading; no CUDA install is required to build)?
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { sys::is_culib_present() }
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Invalid(format!("NVRTC {what} failed: {r:?}")))
    }
}

/// Compile `src` (file name `name`, for messages) to a CUBIN for `arch` (e.g. "sm_90").
pub fn compile(name: &str, src: &str, arch: &str, defines: &[String]) -> Result<Vec<u8>> {
    compile_with(name, src, arch, defines, &[])
}

/// `compile` with more NVRTC options (`options`, e.g. "--Ofast-compile=max" for the CI
/// compile test's quick pass).
pub fn compile_with(name: &str, src: &str, arch: &str, defines: &[String], options: &[&str]) -> Result<Vec<u8>> {
    if !available() {
        return Err(Error::Unsupported(
            "the NVRTC library (libnvrtc.so) was not found: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and put its lib directory on LD_LIBRARY_PATH".into(),
        ));
    }
    let c = |s: &str| CString::new(s).map_err(|_| Error::Invalid(format!("NUL byte in kernel text {name}")));
    let (src_c, name_c) = (c(src)?, c(name)?);
    let headers = headers();
    let header_src: Vec<CString> = headers.iter().map(|(_, s)| c(s)).collect::<Result<_>>()?;
    let header_name: Vec<CString> = headers.iter().map(|(n, _)| c(n)).collect::<Result<_>>()?;
    let hs: Vec<*const i8> = header_src.iter().map(|s| s.as_ptr()).collect();
    let hn: Vec<*const i8> = header_name.iter().map(|s| s.as_ptr()).collect();
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()];
    opts.extend(defines.iter().map(|d| format!("-D{d}")));
    opts.extend(options.iter().map(|o| o.to_string()));
    let opts_c: Vec<CString> = opts.iter().map(|o| c(o)).collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const i8> = opts_c.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer stays valid for the calls below; prog is destroyed on all paths.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                src_c.as_ptr(),
                name_c.as_ptr(),
                hs.len() as i32,
                hs.as_ptr(),
                hn.as_ptr(),
            ),
            "create program",
        )?;
        let r = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let out = if r != sys::nvrtcResult::NVRTC_SUCCESS {
            let mut n = 0usize;
            sys::nvrtcGetProgramLogSize(prog, &mut n);
            let mut log = vec![0u8; n.max(1)];
            sys::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut i8);
            let log = CStr::from_bytes_until_nul(&log).map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            Err(Error::Invalid(format!("kernel {name} does not compile for {arch} ({r:?}):\n{log}")))
        } else {
            let mut n = 0usize;
            check(sys::nvrtcGetCUBINSize(prog, &mut n), "get CUBIN size").and_then(|_| {
                let mut bin = vec![0u8; n];
                check(sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut i8), "get CUBIN").map(|_| bin)
            })
        };
        sys::nvrtcDestroyProgram(&mut prog);
        out
    }
}

/// 64-bit FNV-1a: stable across Rust versions and machines (std's hasher is not).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for p in parts {
        for &b in p.iter().chain((p.len() as u64).to_le_bytes().iter()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// Cache key: source, headers, options and arch.
pub fn cache_key(name: &str, src: &str, arch: &str, defines: &[String]) -> String {
    let headers = headers();
    let mut parts: Vec<&[u8]> = vec![name.as_bytes(), src.as_bytes(), arch.as_bytes()];
    for (n, s) in &headers {
        parts.push(n.as_bytes());
        parts.push(s.as_bytes());
    }
    for d in defines {
        parts.push(d.as_bytes());
    }
    format!("{}-{arch}-{:016x}", name.trim_end_matches(".cu"), fnv1a(&parts))
}

pub fn cache_dir() -> PathBuf {
    crate::hub::home().join("kernels")
}

/// The CUBIN for a kernel source: from the disk cache, or compiled and stored there
/// (written to a temporary name and renamed, so a crash never leaves a torn file).
pub fn cached(name: &str, src: &str, arch: &str, defines: &[String]) -> Result<(Vec<u8>, bool)> {
    let path = cache_dir().join(format!("{}.cubin", cache_key(name, src, arch, defines)));
    if let Ok(bin) = std::fs::read(&path) {
        return Ok((bin, true));
    }
    let bin = compile(name, src, arch, defines)?;
    let dir = cache_dir();
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp =
            dir.join(format!(".{}.{}", std::process::id(), path.file_name().unwrap_or_default().to_string_lossy()));
        if std::fs::write(&tmp, &bin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((bin, false))
}

/// Compile every kernel variant the backend may load on `arch` (kernels::all_variants_for)
/// into the disk cache, on all cores: a later start (or a GPU test run) then compiles
/// nothing. Returns (compiled now, found in the cache).
pub fn warm_cache(arch: &str) -> Result<(usize, usize)> {
    use rayon::prelude::*;
    let hits = std::sync::atomic::AtomicUsize::new(0);
    let variants = super::kernels::all_variants_for(arch);
    variants.par_iter().try_for_each(|(f, defines)| {
        let (_, hit) = cached(f.name, &source(f.name, f.src), &compile_arch(f.name, arch), defines)?;
        if hit {
            hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok::<(), Error>(())
    })?;
    let hits = hits.into_inner();
    Ok((variants.len() - hits, hits))
}

/// Remove the cached CUBINs for `arch` that no current kernel variant uses (left by older
/// kernel sources or options), so the cache holds what `warm_cache` makes and no more.
/// Returns how many files went.
pub fn prune_cache(arch: &str) -> Result<usize> {
    prune_cache_in(&cache_dir(), arch)
}

fn prune_cache_in(dir: &std::path::Path, arch: &str) -> Result<usize> {
    let variants = super::kernels::all_variants_for(arch);
    let keep: std::collections::HashSet<String> = variants
        .iter()
        .map(|(f, defines)| {
            format!("{}.cubin", cache_key(f.name, &source(f.name, f.src), &compile_arch(f.name, arch), defines))
        })
        .collect();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::Invalid(format!("reading the kernel cache {}: {e}", dir.display()))),
    };
    // Only the CUBINs built for this device ("<file>-<arch>-<hash>.cubin", its own arch or
    // the sm_90a of its architecture-specific files): other devices' stay.
    let tags: std::collections::HashSet<String> =
        variants.iter().map(|(f, _)| format!("-{}-", compile_arch(f.name, arch))).collect();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name.ends_with(".cubin") && tags.iter().any(|t| name.contains(t.as_str()));
        if ours && !keep.contains(&name) {
            std::fs::remove_file(entry.path())
                .map_err(|e| Error::Invalid(format!("removing {} from the kernel cache: {e}", name)))?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_every_input() {
        let d = vec!["BITS=4".to_string()];
        let k = cache_key("qmv.cu", "src", "sm_90", &d);
        assert_ne!(k, cache_key("qmv.cu", "src2", "sm_90", &d));
        assert_ne!(k, cache_key("qmv.cu", "src", "sm_80", &d));
        assert_ne!(k, cache_key("qmv.cu", "src", "sm_90", &["BITS=8".to_string()]));
        assert_eq!(k, cache_key("qmv.cu", "src", "sm_90", &d));
        assert!(k.starts_with("qmv-sm_90-"));
    }

    #[test]
    fn prune_keeps_current_variants_and_other_arches() {
        let dir = std::env::temp_dir().join(format!("ferrolm-prune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (f, defines) = &crate::backend::cuda::kernels::all_variants()[0];
        let current = format!("{}.cubin", cache_key(f.name, &source(f.name, f.src), "sm_90", defines));
        let files =
            [current.as_str(), "gemv-sm_90-00000000deadbeef.cubin", "gemv-sm_80-00000000deadbeef.cubin", "notes.txt"];
        for name in files {
            std::fs::write(dir.join(name), b"x").unwrap();
        }
        assert_eq!(prune_cache_in(&dir, "sm_90").unwrap(), 1);
        let left: Vec<bool> = files.iter().map(|n| dir.join(n).exists()).collect();
        assert_eq!(left, [true, false, true, true], "current, stale sm_90, sm_80, other file");
        assert_eq!(prune_cache_in(&dir.join("missing"), "sm_90").unwrap(), 0, "no cache: nothing to do");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
