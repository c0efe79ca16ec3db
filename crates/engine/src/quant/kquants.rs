//! K-quant super-blocks (Q4_K, Q5_K, Q6_K) → affine groups.

use super::ggml::GgmlType;
use super::Weight;
use crate::{Error, Result};

pub fn import(ty: GgmlType, _data: &[u8], rows: usize, cols: usize) -> Result<Weight> {
    Err(Error::Unsupported(format!("{} import for [{rows}, {cols}] is not written yet", ty.name())))
}
