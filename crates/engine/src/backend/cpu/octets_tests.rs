//! octets.rs's tests: the layout keeps every value, and the octet kernels give each x row
//! the same bits alone or batched, in any tile, AVX2 or VNNI. (Their products against an
//! f64 reference: qdot_tests.rs and matmul.rs's tests, whose matrices of whole octets take
//! this layout.)

use super::*;
use crate::backend::cpu::qdot::{Bf16Src, F16Src, F32Src, Mat, QuantX};
use crate::backend::cpu::qdot_octets::{octet_rows, octet_rows_vnni, Lanes8};
use crate::backend::cpu::simd::{has_avx2, has_avx512_vnni};
use crate::quant::affine::ScaleDtype;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

const DTYPES: [ScaleDtype; 3] = [ScaleDtype::F16, ScaleDtype::BF16, ScaleDtype::F32];

#[test]
fn octet_rows_dequantize_as_the_affine_rows() {
    let (n, k) = (21, 256);
    let mut seed = 3u64;
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            for dtype in DTYPES {
                let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
                let a = AffineTensor::quantize(&w, n, k, bits, group, dtype).unwrap();
                assert!(Octets::takes(&a));
                let o = Octets::from_affine(&a);
                // The same bytes, and three padding rows' in the last octet.
                assert_eq!(o.byte_size(), a.byte_size() / n * 24);
                let (mut want, mut got) = (vec![0f32; k], vec![0f32; k]);
                for r in 0..n {
                    a.dequant_row(r, &mut want);
                    o.row_f32(r, &mut got);
                    let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits_of(&got), bits_of(&want), "{bits}-bit g{group} {dtype:?} row {r}");
                }
            }
        }
    }
}

#[test]
fn octets_take_only_what_their_kernels_read() {
    let q = |rows, bits, group| AffineTensor::quantize(&vec![0.5; rows * 128], rows, 128, bits, group, ScaleDtype::F16);
    assert!(Octets::takes(&q(16, 4, 64).unwrap()));
    assert!(Octets::takes(&q(12, 8, 32).unwrap()), "a partial octet");
    assert!(!Octets::takes(&q(16, 4, 16).unwrap()), "group 16");
    assert!(!Octets::takes(&q(16, 6, 32).unwrap()), "6 bits");
}

/// x rows t of an [rows, n] product through the octet kernels.
fn run<S: Lanes8>(m: &Mat<S>, bits: u32, x: &QuantX, n: usize, vnni: bool) -> Vec<f32> {
    let sums = x.group_sums(m.group);
    let mut out = vec![0.25f32; x.rows * n];
    let o = out.as_mut_ptr();
    // SAFETY: AVX2 (and, for vnni, AVX-512 VNNI) checked by the caller; out is [rows, n].
    unsafe {
        match (bits, vnni) {
            (4, true) => octet_rows_vnni::<4, S>(m, x, &sums, (0, n), o, n),
            (4, false) => octet_rows::<4, S>(m, x, &sums, (0, n), o, n),
            (_, true) => octet_rows_vnni::<8, S>(m, x, &sums, (0, n), o, n),
            (_, false) => octet_rows::<8, S>(m, x, &sums, (0, n), o, n),
        }
    }
    out
}

/// Each x row of a 19-row call gets the bits it gets in calls of 1-16 rows (every tile
/// size and their mixes), through the AVX2 form and (where present) the VNNI one, for
/// whole-row sums and for sums unit by unit continuing the output (tensor parallelism's).
#[test]
fn octet_rows_give_each_x_row_its_bits_alone_and_batched() {
    if !has_avx2() {
        eprintln!("skipped: no AVX2");
        return;
    }
    let k = 256;
    let mut seed = 11u64;
    // 16 rows: whole octets; 13: the last one partial (masked stores).
    for (n, bits) in [(16, 4), (16, 8), (13, 4), (13, 8)] {
        for group in [32, 64, 128] {
            for dtype in DTYPES {
                let w: Vec<f32> = (0..n * k).map(|_| 0.3 + lcg(&mut seed)).collect();
                let o = Octets::from_affine(&AffineTensor::quantize(&w, n, k, bits, group, dtype).unwrap());
                let x: Vec<f32> = (0..19 * k).map(|i| (i as f32 * 0.37).sin() * (1 + i / 700) as f32).collect();
                for (unit, accumulate) in [(k, false), (k / 2, true), (128, false)] {
                    let what = format!("{bits}-bit g{group} {dtype:?} unit {unit} accumulate {accumulate}");
                    let check = |m: &dyn Fn(&QuantX, bool) -> Vec<f32>| {
                        let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let all = m(&QuantX::new(&x, k), false);
                        assert!(all.iter().all(|v| v.is_finite()), "{what}");
                        for rows in [1, 2, 3, 4, 5, 7, 8, 9, 16, 19] {
                            let xr = QuantX::new(&x[..rows * k], k);
                            for vnni in [false, true].into_iter().filter(|&v| !v || has_avx512_vnni()) {
                                let part = m(&xr, vnni);
                                let v = if vnni { "VNNI" } else { "AVX2" };
                                assert_eq!(bits_of(&part), bits_of(&all[..rows * n]), "{what}: {rows} rows ({v})");
                            }
                        }
                    };
                    macro_rules! mat {
                        ($lanes:expr, $s:expr, $b:expr) => {
                            Mat {
                                bytes: &o.q,
                                cols: k,
                                group,
                                scales: $lanes($s),
                                biases: $lanes($b),
                                unit,
                                accumulate,
                            }
                        };
                    }
                    match (&o.scales, &o.biases) {
                        (Scales::F16(s), Scales::F16(b)) => {
                            let m = mat!(F16Src, bytemuck::cast_slice(s), bytemuck::cast_slice(b));
                            check(&|x, v| run(&m, bits, x, n, v))
                        }
                        (Scales::BF16(s), Scales::BF16(b)) => {
                            let m = mat!(Bf16Src, bytemuck::cast_slice(s), bytemuck::cast_slice(b));
                            check(&|x, v| run(&m, bits, x, n, v))
                        }
                        (Scales::F32(s), Scales::F32(b)) => check(&|x, v| run(&mat!(F32Src, s, b), bits, x, n, v)),
                        _ => unreachable!(),
                    }
                }
            }
        }
    }
}
