//! The TurboQuant codec against its reference's vectors (vllm-metal's turboquant.py run
//! with MLX): every index, scale, zero point, packed byte and decoded value, for every
//! input dtype, head dim and bit width the file holds. The file is
//! tests/goldens/turboquant/codec-goldens.json (a copy of ../shared/goldens/turboquant/'s),
//! or the one `FERROLM_TQ_GOLDENS` names:
//!     FERROLM_TQ_GOLDENS=FILE cargo test turboquant

use ferrolm::kv::turboquant::{
    decode_key_group, decode_values, encode_key_group, encode_values, pack_bits, rotate, unpack_bit, KeyFormat,
    Precision, GROUP,
};
use serde_json::Value;
use std::collections::HashSet;
use std::path::PathBuf;

fn goldens() -> Value {
    let path = ferrolm::env::tq_goldens().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/turboquant/codec-goldens.json")
    });
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    // Python's json writes the reference's NaN (degenerate key groups) bare; JSON has null.
    let text = text.replace("NaN", "null");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

fn precision(dtype: &str) -> Precision {
    match dtype {
        "float32" => Precision::F32,
        "float16" => Precision::F16,
        "bfloat16" => Precision::Bf16,
        d => panic!("goldens: unknown dtype {d}"),
    }
}

fn rows_f32(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect()
}

fn rows_i64(v: &Value) -> Vec<Vec<i64>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()).collect()
}

/// The reference writes NaN as null in its dequantized values (degenerate groups).
fn rows_f32_or_nan(v: &Value) -> Vec<Vec<f32>> {
    let val = |x: &Value| x.as_f64().map_or(f32::NAN, |f| f as f32);
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(val).collect()).collect()
}

fn degenerate(v: &Value) -> HashSet<(usize, usize)> {
    v["degenerate_groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap() as usize, p[1].as_u64().unwrap() as usize))
        .collect()
}

/// Checks one key format of one case; returns the groups compared.
fn check_keys(name: &str, x: &[Vec<f32>], p: Precision, k: &Value) -> usize {
    let fmt = KeyFormat { bits: k["bits"].as_u64().unwrap() as u32, signed: k["signed"].as_bool().unwrap() };
    let (idx, scale, zero) = (rows_i64(&k["indices"]), rows_i64(&k["scale_f16_bits"]), rows_i64(&k["zero_f16_bits"]));
    let deq = rows_f32_or_nan(&k["dequant"]);
    let packed = (!k["packed"].is_null()).then(|| rows_i64(&k["packed"]));
    let skip = degenerate(k);
    let mut compared = 0;
    for (r, row) in x.iter().enumerate() {
        for (gi, g) in row.chunks(GROUP).enumerate() {
            let enc = encode_key_group(g, p, fmt);
            let mut out = [0f32; GROUP];
            decode_key_group(&enc, &mut out);
            let at = format!("{name} keys row {r} group {gi}");
            if skip.contains(&(r, gi)) {
                // Ours to choose, but finite and the constant within f16 rounding.
                for (o, v) in out.iter().zip(g) {
                    assert!(
                        o.is_finite() && (o - v).abs() <= v.abs() * 1e-3,
                        "{at}: degenerate group decodes {o} for {v}"
                    );
                }
                continue;
            }
            let want_idx: Vec<i32> = idx[r][gi * GROUP..(gi + 1) * GROUP].iter().map(|&v| v as i32).collect();
            assert_eq!(enc.idx.to_vec(), want_idx, "{at}: indices");
            assert_eq!(enc.scale as i64, scale[r][gi], "{at}: scale bits");
            assert_eq!(enc.zero as i64, zero[r][gi], "{at}: zero point bits");
            for (i, (o, w)) in out.iter().zip(&deq[r][gi * GROUP..]).enumerate() {
                assert_eq!(o.to_bits(), w.to_bits(), "{at}: dequantized value {i}: {o} vs {w}");
            }
            if let Some(pk) = &packed {
                let bytes = GROUP * fmt.bits as usize / 8;
                let mut ours = vec![0u8; bytes];
                pack_bits(enc.idx.iter().map(|&v| v as u32), fmt.bits, &mut ours);
                let want: Vec<u8> = pk[r][gi * bytes..(gi + 1) * bytes].iter().map(|&b| b as u8).collect();
                assert_eq!(ours, want, "{at}: packed bytes");
                for (i, &v) in enc.idx.iter().enumerate() {
                    assert_eq!(unpack_bit(&ours, fmt.bits, i), v as u32, "{at}: unpacked index {i}");
                }
            }
            compared += 1;
        }
    }
    compared
}

/// Checks one value bit width of one case; returns the heads compared.
fn check_values(name: &str, x: &[Vec<f32>], p: Precision, bits: u32, v: &Value) -> usize {
    let (idx, scale, deq) = (rows_i64(&v["indices"]), rows_i64(&v["scale_f16_bits"]), rows_f32(&v["dequant"]));
    let packed = (!v["packed"].is_null()).then(|| rows_i64(&v["packed"]));
    assert!(
        degenerate(v).is_empty(),
        "{name}: the value goldens list degenerate groups; this test does not expect any"
    );
    for (r, row) in x.iter().enumerate() {
        let at = format!("{name} values {bits}-bit row {r}");
        let (mut qi, mut qs) = (vec![0u8; row.len()], vec![0u16; row.len() / GROUP]);
        encode_values(row, p, bits, &mut qi, &mut qs).unwrap();
        assert_eq!(qi.iter().map(|&q| q as i64).collect::<Vec<_>>(), idx[r], "{at}: indices");
        assert_eq!(qs.iter().map(|&s| s as i64).collect::<Vec<_>>(), scale[r], "{at}: scale bits");
        if let Some(pk) = &packed {
            let mut ours = vec![0u8; row.len() * bits as usize / 8];
            pack_bits(qi.iter().map(|&q| q as u32), bits, &mut ours);
            assert_eq!(ours.iter().map(|&b| b as i64).collect::<Vec<_>>(), pk[r], "{at}: packed bytes");
        }
        let mut out = vec![0f32; row.len()];
        decode_values(&qi, &qs, bits, &mut out).unwrap();
        for (i, (o, w)) in out.iter().zip(&deq[r]).enumerate() {
            assert_eq!(o.to_bits(), w.to_bits(), "{at}: decoded value {i}: {o} vs {w}");
        }
    }
    x.len()
}

#[test]
fn turboquant_codec_matches_the_reference_goldens() {
    let g = goldens();
    let mut seen = HashSet::new();
    let (mut key_groups, mut value_heads) = (0, 0);
    for case in g["cases"].as_array().unwrap() {
        let hd = case["head_dim"].as_u64().unwrap() as usize;
        let dtype = case["dtype"].as_str().unwrap();
        let p = precision(dtype);
        let x = rows_f32(&case["x"]);
        let name = format!("head_dim {hd} {dtype}");
        for (kt, k) in case["keys"].as_object().unwrap() {
            key_groups += check_keys(&format!("{name} {kt}"), &x, p, k);
            seen.insert(format!("k{}{}", k["bits"], k["signed"]));
        }
        for (bits, v) in case["values"].as_object().unwrap() {
            if bits == "rotated" {
                let want = rows_f32(v);
                for (r, row) in x.iter().enumerate() {
                    let mut y = row.clone();
                    rotate(&mut y, p).unwrap();
                    let same = y.iter().zip(&want[r]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{name} row {r}: the forward rotation differs from the reference's");
                }
                continue;
            }
            value_heads += check_values(&name, &x, p, bits.parse().unwrap(), v);
            seen.insert(format!("v{bits}"));
        }
        seen.insert(format!("{hd} {dtype}"));
    }
    // The default file covers 3 head dims × 3 dtypes, 5 key formats and 5 value widths.
    assert!(seen.len() >= 19 && key_groups > 0 && value_heads > 0, "goldens cover too little: {seen:?}");
}

#[test]
fn other_head_dims_are_refused_by_name() {
    let x = vec![0.5f32; 96];
    let (mut qi, mut qs) = (vec![0u8; 96], vec![0u16; 3]);
    let err = encode_values(&x, Precision::F32, 3, &mut qi, &mut qs).unwrap_err().to_string();
    assert!(err.contains("head dim") && err.contains("96"), "{err}");
    let err = encode_values(&x[..64], Precision::F32, 6, &mut qi, &mut qs).unwrap_err().to_string();
    assert!(err.contains("6 bits"), "{err}");
}
