//! KV files on CUDA: a session's cache saved and restored continues exactly as the
//! uninterrupted generation; a file the CPU saved loads on CUDA with the same row bytes
//! (the payload does not depend on the backend), for bf16 and quantized schemes.

use super::models::smollm2;
use ferrolm::backend::Backend;
use ferrolm::generate::Session;
use ferrolm::sample::{Sampler, SamplerConfig};

fn greedy<B: Backend>(s: &mut Session<'_, B>, prompt: &[u32], n: usize) -> (Vec<u32>, usize) {
    let mut out = vec![];
    let st = s
        .generate(prompt, n, &mut Sampler::new(SamplerConfig::default()), &[], |t| {
            out.push(t);
            Ok(true)
        })
        .unwrap();
    (out, st.prefilled)
}

#[test]
fn kv_files_save_restore_and_cross_backends() {
    let (mut mc, mut mg, tok) = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let fp = "fingerprint";
    let prompt = tok.encode("The history of the Roman Empire begins with", true).unwrap();
    for scheme in ["bf16", "turbo:k8v3", "affine:4"] {
        let kv = ferrolm::kv::scheme::KvScheme::parse(scheme).unwrap();
        mc.set_kv_scheme(kv.clone()).unwrap();
        mg.set_kv_scheme(kv).unwrap();
        let path = dir.path().join(format!("g-{scheme}.kv"));
        let (whole, _) = greedy(&mut Session::new(&mg, 256).unwrap(), &prompt, 40);
        let mut s = Session::new(&mg, 256).unwrap();
        let (head, _) = greedy(&mut s, &prompt, 12);
        s.save_cache(&path, fp).unwrap();
        drop(s);
        let mut s = Session::new(&mg, 256).unwrap();
        assert!(s.restore_cache(&path, fp).unwrap().is_some());
        let (tail, prefilled) = greedy(&mut s, &[&prompt[..], &head].concat(), 28);
        assert_eq!((prefilled, [head, tail].concat()), (1, whole), "--kv {scheme}");
        drop(s);
        // The CPU's file restored on CUDA and saved again: the same bytes.
        let (from_cpu, again) = (dir.path().join(format!("c-{scheme}.kv")), dir.path().join(format!("c2-{scheme}.kv")));
        let mut s = Session::new(&mc, 256).unwrap();
        greedy(&mut s, &prompt, 12);
        s.save_cache(&from_cpu, fp).unwrap();
        let mut s = Session::new(&mg, 256).unwrap();
        assert!(s.restore_cache(&from_cpu, fp).unwrap().is_some());
        s.save_cache(&again, fp).unwrap();
        assert!(
            std::fs::read(&from_cpu).unwrap() == std::fs::read(&again).unwrap(),
            "CPU -> CUDA -> file, --kv {scheme}"
        );
    }
}
