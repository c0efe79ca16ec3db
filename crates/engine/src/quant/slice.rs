//! Parts of a weight matrix as matrices of their own: tensor parallelism gives each rank
//! some of a matrix's rows (its heads, FFN columns or vocabulary) or some of its columns
//! (the input columns of the output projections), quantization groups whole.

use super::{AffineTensor, DenseData, DenseTensor, Scales, Weight};
use crate::{Error, Result};
use std::ops::Range;

/// Values `cols` of each row in `rows` of a row-major `[_, width]` array, row after row.
fn take<T: Copy>(v: &[T], width: usize, rows: &Range<usize>, cols: &Range<usize>) -> Vec<T> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for r in rows.clone() {
        out.extend_from_slice(&v[r * width + cols.start..r * width + cols.end]);
    }
    out
}

impl Scales {
    /// `take` over a `[_, width]` array of scales.
    fn take(&self, width: usize, rows: &Range<usize>, cols: &Range<usize>) -> Scales {
        match self {
            Scales::F16(v) => Scales::F16(take(v, width, rows, cols)),
            Scales::BF16(v) => Scales::BF16(take(v, width, rows, cols)),
            Scales::F32(v) => Scales::F32(take(v, width, rows, cols)),
        }
    }
}

impl AffineTensor {
    /// Rows `rows` and columns `cols` as a tensor of their own. The columns must start and
    /// end on group boundaries (and whole packed words): a group is never cut.
    pub fn part(&self, rows: Range<usize>, cols: Range<usize>) -> Result<AffineTensor> {
        let g = self.group;
        let whole = |c: usize| c == self.cols || Weight::affine_cut(self, c);
        if rows.start > rows.end || rows.end > self.rows || cols.start >= cols.end || cols.end > self.cols {
            return Err(Error::Invalid(format!(
                "part [{rows:?}, {cols:?}] of a [{}, {}] matrix",
                self.rows, self.cols
            )));
        }
        if !whole(cols.start) || !whole(cols.end) {
            return Err(Error::Unsupported(format!(
                "splitting a {}-bit matrix of {}-value groups at column {}: a shard boundary would cut a quantization group",
                self.bits,
                g,
                if whole(cols.start) { cols.end } else { cols.start }
            )));
        }
        let bits = self.bits as usize;
        let words = cols.start * bits / 32..cols.end * bits / 32;
        let packed = take(&self.packed, self.words_per_row(), &rows, &words);
        let groups = cols.start / g..cols.end / g;
        let (scales, biases) = (
            self.scales.take(self.groups_per_row(), &rows, &groups),
            self.biases.take(self.groups_per_row(), &rows, &groups),
        );
        AffineTensor::new(rows.len(), cols.len(), self.bits, g, packed, scales, biases)
    }
}

impl Weight {
    /// Whether the matrix can be cut before column `c` (0 < c < cols) with every part
    /// summing its products as the whole does: at a multiple of 32 (the CPU quantizes
    /// activations in blocks of 32) and, quantized, of the group.
    pub fn cuts_at(&self, c: usize) -> bool {
        match self {
            Weight::Affine(t) => Weight::affine_cut(t, c),
            Weight::Dense(_) => c.is_multiple_of(32),
        }
    }

    fn affine_cut(t: &AffineTensor, c: usize) -> bool {
        c.is_multiple_of(32) && c.is_multiple_of(t.group) && (c * t.bits as usize).is_multiple_of(32)
    }

    /// Rows `rows` and columns `cols` of the matrix as a weight of its own (a quantized
    /// matrix only at its groups' boundaries).
    pub fn part(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Weight> {
        match self {
            Weight::Affine(t) => t.part(rows, cols).map(Weight::Affine),
            Weight::Dense(t) => {
                if rows.start > rows.end || rows.end > t.rows || cols.start >= cols.end || cols.end > t.cols {
                    return Err(Error::Invalid(format!(
                        "part [{rows:?}, {cols:?}] of a [{}, {}] matrix",
                        t.rows, t.cols
                    )));
                }
                let data = match &t.data {
                    DenseData::F32(v) => DenseData::F32(take(v, t.cols, &rows, &cols)),
                    DenseData::F16(v) => DenseData::F16(take(v, t.cols, &rows, &cols)),
                    DenseData::BF16(v) => DenseData::BF16(take(v, t.cols, &rows, &cols)),
                };
                Ok(Weight::Dense(DenseTensor { rows: rows.len(), cols: cols.len(), data }))
            }
        }
    }

    /// Rows `rows`, every column.
    pub fn rows_part(&self, rows: Range<usize>) -> Result<Weight> {
        self.part(rows, 0..self.cols())
    }

    /// Columns `cols`, every row.
    pub fn cols_part(&self, cols: Range<usize>) -> Result<Weight> {
        self.part(0..self.rows(), cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::ScaleDtype;

    fn matrix(rows: usize, cols: usize, bits: u32, group: usize) -> AffineTensor {
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 97) as f32 - 48.0) / 17.0).collect();
        AffineTensor::quantize(&w, rows, cols, bits, group, ScaleDtype::F16).unwrap()
    }

    #[test]
    fn a_part_dequantizes_to_the_same_values() {
        for (bits, group) in [(4, 32), (3, 32), (5, 64), (6, 16), (8, 128), (2, 64)] {
            let t = matrix(6, 256, bits, group);
            let full = t.dequantize();
            let (rows, cols) = (1..5, 128..256);
            let p = t.part(rows.clone(), cols.clone()).unwrap().dequantize();
            let want: Vec<f32> = rows.flat_map(|r| full[r * 256 + cols.start..r * 256 + cols.end].to_vec()).collect();
            assert_eq!(p, want, "{bits}-bit g{group}");
        }
    }

    #[test]
    fn a_cut_group_is_refused_by_name() {
        let t = Weight::Affine(matrix(4, 256, 4, 64));
        let e = t.cols_part(0..96).unwrap_err().to_string();
        assert!(e.contains("cut a quantization group") && e.contains("96"), "{e}");
        assert!(t.rows_part(0..5).is_err());
        assert!(t.cols_part(64..128).is_ok());
    }
}
