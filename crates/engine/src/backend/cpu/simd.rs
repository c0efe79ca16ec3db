//! AVX2+FMA inner loops for the quantized matmul (x86-64), chosen at run time.
//!
//! Where the time goes in decode: each weight value is unpacked (broadcast word, variable
//! shift, mask, int→float; 3/5/6/2-bit values from one unaligned u64 per 8) and multiplied
//! into 8 lanes; the group scale folds into a row
//! accumulator once per group, so there is one horizontal sum per output row.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

pub fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// AVX-512 F, VL, BW and VNNI beside AVX2 (qdot.rs's `rows_vnni`).
pub fn has_avx512_vnni() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx2()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `hsum` of each of four vectors as the lanes of one, in one transposing network whose
/// adds pair the lanes as `hsum`'s do (lane i + lane i+4, then 0+2 and 1+3, then those
/// two), so each lane has `hsum`'s bits.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn hsum4(v: &[__m256; 4]) -> __m128 {
    // (No closures: they would not inherit the caller's target features.)
    // [a's lane i + lane i+4 for i < 4 | b's]
    let h01 = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(v[0], v[1]), _mm256_permute2f128_ps::<0x31>(v[0], v[1]));
    let h23 = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(v[2], v[3]), _mm256_permute2f128_ps::<0x31>(v[2], v[3]));
    // [v0: 0+2, 1+3, v2: 0+2, 1+3 | v1: …, v3: …]
    let p = _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(h01, h23), _mm256_shuffle_ps::<0b11_10_11_10>(h01, h23));
    // [v0, v2, v0, v2 | v1, v3, v1, v3]
    let q = _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(p, p), _mm256_shuffle_ps::<0b11_01_11_01>(p, p));
    _mm_unpacklo_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q))
}

/// 8 consecutive q values (as f32) starting at value 8·i of a row of `nbytes` bytes.
/// 4 bits: one word, shifted per lane; 8 bits: 8 bytes widened. Any other width: the 8
/// values are the BITS bytes at byte 8·i·BITS/8 of the LSB-first stream, read as one u64
/// and shifted per lane in 64-bit halves (a value may cross a word), then masked.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load8<const BITS: u32>(words: *const u32, i: usize, nbytes: usize) -> __m256 {
    if BITS == 4 {
        let w = _mm256_set1_epi32(*words.add(i) as i32);
        let sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(15)))
    } else if BITS == 8 {
        // 8-bit: the LSB-first u32 stream is a plain byte array.
        let b = _mm_loadl_epi64((words as *const u8).add(8 * i) as *const __m128i);
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
    } else {
        let (byte, n) = (i * BITS as usize, BITS as usize);
        let p = (words as *const u8).add(byte);
        // The row's last block reads only its own bytes.
        let u = if byte + 8 <= nbytes {
            std::ptr::read_unaligned(p as *const u64)
        } else {
            let mut b = [0u8; 8];
            std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), n);
            u64::from_le_bytes(b)
        };
        let v = _mm256_set1_epi64x(u as i64);
        let b = BITS as i64;
        let lo = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, b, 2 * b, 3 * b));
        let hi = _mm256_srlv_epi64(v, _mm256_setr_epi64x(4 * b, 5 * b, 6 * b, 7 * b));
        // The low 32 bits of each 64-bit lane: values 0-3 from lo, 4-7 from hi.
        let idx = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        let q = _mm256_blend_epi32::<0b1111_0000>(
            _mm256_permutevar8x32_epi32(lo, idx),
            _mm256_permutevar8x32_epi32(hi, idx),
        );
        _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32((1 << BITS) - 1)))
    }
}

/// Unpack a row (BITS 2-8) into f32 (prefill reuses it for every token).
///
/// # Safety
/// CPU must support AVX2; out.len() = cols, words.len() = cols·BITS/32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn unpack<const BITS: u32>(words: &[u32], out: &mut [f32]) {
    let (wp, op, nb) = (words.as_ptr(), out.as_mut_ptr(), 4 * words.len());
    for i in 0..out.len() / 8 {
        _mm256_storeu_ps(op.add(8 * i), load8::<BITS>(wp, i, nb));
    }
}

/// Σ_g scale_g · (q_g · x_g) over an unpacked row (one accumulator per group, 8 values at
/// a time).
///
/// # Safety
/// CPU must support AVX2+FMA; q and x have the same length, a multiple of group (≥ 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_groups(q: &[f32], x: &[f32], scales: &[f32], group: usize) -> f32 {
    let (qp, xp) = (q.as_ptr(), x.as_ptr());
    let mut racc = _mm256_setzero_ps();
    for (g, &s) in scales.iter().enumerate() {
        let mut acc = _mm256_setzero_ps();
        let mut j = g * group;
        while j < (g + 1) * group {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(j)), _mm256_loadu_ps(xp.add(j)), acc);
            j += 8;
        }
        racc = _mm256_fmadd_ps(acc, _mm256_set1_ps(s), racc);
    }
    hsum(racc)
}

/// f16 bits → f32 (F16C, 8 at a time).
///
/// # Safety
/// CPU must support AVX2+F16C; src.len() == dst.len().
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    while i < n {
        dst[i] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(src[i] as i32)));
        i += 1;
    }
}

/// q · k with k stored as bf16 bits (converted by a 16-bit shift, 8 lanes at a time).
///
/// # Safety
/// CPU must support AVX2+FMA; q.len() == k.len(), a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_bf16(q: &[f32], k: &[u16]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for j in (0..q.len()).step_by(8) {
        let kv = bf16x8(k.as_ptr().add(j));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(j)), kv, acc);
    }
    hsum(acc)
}

/// out += w · v with v stored as bf16 bits.
///
/// # Safety
/// CPU must support AVX2+FMA; out.len() == v.len(), a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy_bf16(out: &mut [f32], w: f32, v: &[u16]) {
    let wv = _mm256_set1_ps(w);
    for j in (0..out.len()).step_by(8) {
        let o = out.as_mut_ptr().add(j);
        _mm256_storeu_ps(o, _mm256_fmadd_ps(wv, bf16x8(v.as_ptr().add(j)), _mm256_loadu_ps(o)));
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bf16x8(p: *const u16) -> __m256 {
    let h = _mm_loadu_si128(p as *const __m128i);
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
}

/// Plain dot product.
///
/// # Safety
/// CPU must support AVX2+FMA; a.len() == b.len().
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut j = 0;
    while j + 16 <= n {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(j)), _mm256_loadu_ps(bp.add(j)), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(j + 8)), _mm256_loadu_ps(bp.add(j + 8)), a1);
        j += 16;
    }
    let mut s = hsum(_mm256_add_ps(a0, a1));
    while j < n {
        s += a[j] * b[j];
        j += 1;
    }
    s
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// hsum4's lanes are hsum's bit for bit (values of mixed magnitudes, so that another
    /// order of the adds rounds differently).
    #[test]
    fn hsum4_is_four_hsums() {
        if !has_avx2() {
            return;
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mant = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            mant * 2f32.powi((seed % 40) as i32 - 20)
        };
        for _ in 0..1000 {
            let lanes: Vec<[f32; 8]> = (0..4).map(|_| std::array::from_fn(|_| next())).collect();
            // SAFETY: AVX2 is present (checked above).
            unsafe {
                let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(lanes[i].as_ptr()));
                let mut got = [0f32; 4];
                _mm_storeu_ps(got.as_mut_ptr(), hsum4(&v));
                for i in 0..4 {
                    assert_eq!(got[i].to_bits(), hsum(v[i]).to_bits(), "vector {i}: {:?}", lanes[i]);
                }
            }
        }
    }
}
