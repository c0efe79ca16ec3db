//! Quantized weights: the internal affine format and the importers of GGUF block types.

pub mod affine;
pub mod ggml;
pub mod kquants;
pub mod scheme;
mod slice;

pub use affine::{AffineTensor, ScaleDtype, Scales};

use half::{bf16, f16};

/// Ask for transparent huge pages under a freshly allocated, not yet written buffer (Linux;
/// a no-op elsewhere or where the kernel declines). Decode streams every weight once per
/// token, and over a large tensor 4 KiB pages cost a TLB miss per page: the 180 MiB head
/// of Gemma 3 270M reads 5-15% faster on 2 MiB pages. Only the 2 MiB-aligned interior is
/// advised; a buffer below 4 MiB is left alone.
pub fn advise_huge_pages<T>(v: &[T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (p, n) = (v.as_ptr() as usize, std::mem::size_of_val(v));
        let (start, end) = (p.next_multiple_of(HUGE), (p + n) / HUGE * HUGE);
        if n >= 2 * HUGE && end > start {
            // SAFETY: the range lies inside v's allocation; MADV_HUGEPAGE changes only how
            // its pages are backed, never their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// An unquantized matrix `[rows, cols]` in its source precision.
#[derive(Clone, Debug)]
pub enum DenseData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

#[derive(Clone, Debug)]
pub struct DenseTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: DenseData,
}

impl DenseTensor {
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let s = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            DenseData::F32(v) => out.copy_from_slice(&v[s]),
            DenseData::F16(v) => v[s].iter().zip(out).for_each(|(a, o)| *o = a.to_f32()),
            DenseData::BF16(v) => v[s].iter().zip(out).for_each(|(a, o)| *o = a.to_f32()),
        }
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
            self.row_f32(r, row);
        }
        out
    }
    pub fn byte_size(&self) -> usize {
        let n = self.rows * self.cols;
        match self.data {
            DenseData::F32(_) => n * 4,
            _ => n * 2,
        }
    }
    pub fn dtype_name(&self) -> &'static str {
        match self.data {
            DenseData::F32(_) => "f32",
            DenseData::F16(_) => "f16",
            DenseData::BF16(_) => "bf16",
        }
    }
}

/// A weight matrix as the model sees it: quantized affine groups or dense.
#[derive(Clone, Debug)]
pub enum Weight {
    Affine(AffineTensor),
    Dense(DenseTensor),
}

impl Weight {
    pub fn rows(&self) -> usize {
        match self {
            Weight::Affine(t) => t.rows,
            Weight::Dense(t) => t.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            Weight::Affine(t) => t.cols,
            Weight::Dense(t) => t.cols,
        }
    }
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::Affine(t) => t.dequant_row(r, out),
            Weight::Dense(t) => t.row_f32(r, out),
        }
    }
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            Weight::Affine(t) => t.dequantize(),
            Weight::Dense(t) => t.to_f32_vec(),
        }
    }
    pub fn byte_size(&self) -> usize {
        match self {
            Weight::Affine(t) => t.byte_size(),
            Weight::Dense(t) => t.byte_size(),
        }
    }
    /// Rows [0, n) as a weight of their own (n ≤ rows): the head of a padded vocabulary.
    pub fn first_rows(&self, n: usize) -> crate::Result<Weight> {
        Ok(match self {
            Weight::Affine(t) => Weight::Affine(t.first_rows(n)?),
            Weight::Dense(t) => {
                let (n, c) = (n.min(t.rows), t.cols);
                let data = match &t.data {
                    DenseData::F32(v) => DenseData::F32(v[..n * c].to_vec()),
                    DenseData::F16(v) => DenseData::F16(v[..n * c].to_vec()),
                    DenseData::BF16(v) => DenseData::BF16(v[..n * c].to_vec()),
                };
                Weight::Dense(DenseTensor { rows: n, cols: c, data })
            }
        })
    }
    /// Short description for `inspect`: "q4 g32 f16" or "bf16".
    pub fn describe(&self) -> String {
        match self {
            Weight::Affine(t) => format!("q{} g{} {}", t.bits, t.group, t.scales.dtype().name()),
            Weight::Dense(t) => t.dtype_name().to_string(),
        }
    }
}
