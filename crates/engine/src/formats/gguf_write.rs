//! GGUF v3 writer: typed metadata, tensors in ggml order, data aligned to
//! `general.alignment` (default 32). Made for tests and tools (tiny random models, converted
//! files); it builds the whole file in memory.
//!
//! ```no_run
//! # use ferrolm::formats::gguf_write::GgufWriter;
//! let mut w = GgufWriter::new();
//! w.string("general.architecture", "llama").u32("llama.embedding_length", 64);
//! w.tensor_f32("output_norm.weight", &[64], &[1.0; 64])?;
//! w.write("tiny.gguf")?;
//! # Ok::<(), ferrolm::Error>(())
//! ```

use super::gguf::MetaValue;
use crate::quant::ggml::GgmlType;
use crate::{Error, Result};
use half::f16;
use std::path::Path;

const DEFAULT_ALIGNMENT: u64 = 32;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builder for a GGUF v3 file. Metadata keys keep insertion order (setting a key twice
/// replaces its value in place); tensors keep insertion order.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue, Option<u32>)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    fn put(&mut self, key: &str, v: MetaValue, elem: Option<u32>) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _, _)| k == key) {
            Some(slot) => (slot.1, slot.2) = (v, elem),
            None => self.metadata.push((key.to_string(), v, elem)),
        }
        self
    }

    /// Any value. An array's element type is taken from its first element (an empty one is
    /// written as a u32 array: it holds nothing, so readers see the same empty array).
    pub fn value(&mut self, key: &str, v: MetaValue) -> &mut Self {
        self.put(key, v, None)
    }
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.put(key, MetaValue::U32(v), None)
    }
    pub fn u64(&mut self, key: &str, v: u64) -> &mut Self {
        self.put(key, MetaValue::U64(v), None)
    }
    pub fn i32(&mut self, key: &str, v: i32) -> &mut Self {
        self.put(key, MetaValue::I32(v), None)
    }
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.put(key, MetaValue::F32(v), None)
    }
    pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.put(key, MetaValue::Bool(v), None)
    }
    pub fn string(&mut self, key: &str, v: &str) -> &mut Self {
        self.put(key, MetaValue::Str(v.to_string()), None)
    }
    pub fn string_array<S: AsRef<str>>(&mut self, key: &str, v: &[S]) -> &mut Self {
        let a = v.iter().map(|s| MetaValue::Str(s.as_ref().into())).collect();
        self.put(key, MetaValue::Array(a), Some(8))
    }
    pub fn i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let a = v.iter().map(|&x| MetaValue::I32(x)).collect();
        self.put(key, MetaValue::Array(a), Some(5))
    }
    pub fn f32_array(&mut self, key: &str, v: &[f32]) -> &mut Self {
        let a = v.iter().map(|&x| MetaValue::F32(x)).collect();
        self.put(key, MetaValue::Array(a), Some(6))
    }
    /// Drop a metadata key (no-op when absent): handy for building deliberately bad files.
    pub fn remove(&mut self, key: &str) -> &mut Self {
        self.metadata.retain(|(k, _, _)| k != key);
        self
    }
    /// Sets `general.alignment` (a power of two) for the tensor data.
    pub fn alignment(&mut self, a: u32) -> &mut Self {
        self.u32("general.alignment", a)
    }

    /// A tensor with raw ggml bytes. `dims` are in ggml order (dims[0] is the contiguous
    /// input dim, i.e. a `[rows, cols]` matrix is `&[cols, rows]`); `data` must be exactly
    /// the size of that many whole `ty` blocks per row.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: impl Into<Vec<u8>>) -> Result<&mut Self> {
        let data = data.into();
        let bad = |m: String| Err(Error::Invalid(format!("gguf writer: tensor {name}: {m}")));
        if self.tensors.iter().any(|t| t.name == name) {
            return bad("added twice".into());
        }
        if dims.is_empty() || dims.len() > 4 || dims.contains(&0) {
            return bad(format!("dims {dims:?} (1 to 4 non-zero dims)"));
        }
        let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let need = n
            .and_then(|n| usize::try_from(n).ok())
            .filter(|_| dims[0].is_multiple_of(ty.block().0 as u64))
            .and_then(|n| ty.byte_size(n));
        match need {
            None => bad(format!("dims {dims:?} are not whole {} blocks", ty.name())),
            Some(need) if need != data.len() => {
                bad(format!("{} dims {dims:?} need {need} bytes, got {}", ty.name(), data.len()))
            }
            Some(_) => {
                self.tensors.push(PendingTensor { name: name.to_string(), dims: dims.to_vec(), ty, data });
                Ok(self)
            }
        }
    }
    /// An F32 tensor from values in row-major order (ggml order dims).
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], v: &[f32]) -> Result<&mut Self> {
        self.tensor(name, dims, GgmlType::F32, bytemuck::cast_slice::<f32, u8>(v))
    }
    /// An F16 tensor, each value rounded to nearest f16.
    pub fn tensor_f16(&mut self, name: &str, dims: &[u64], v: &[f32]) -> Result<&mut Self> {
        let b: Vec<u8> = v.iter().flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F16, b)
    }
    /// A Q8_0 tensor quantized with ggml's reference rule (see `quantize_q8_0`).
    pub fn tensor_q8_0(&mut self, name: &str, dims: &[u64], v: &[f32]) -> Result<&mut Self> {
        let b = quantize_q8_0(v).ok_or_else(|| not_blocks(name, v.len()))?;
        self.tensor(name, dims, GgmlType::Q8_0, b)
    }
    /// A Q4_0 tensor quantized with ggml's reference rule (see `quantize_q4_0`).
    pub fn tensor_q4_0(&mut self, name: &str, dims: &[u64], v: &[f32]) -> Result<&mut Self> {
        let b = quantize_q4_0(v).ok_or_else(|| not_blocks(name, v.len()))?;
        self.tensor(name, dims, GgmlType::Q4_0, b)
    }

    /// The alignment the data will use: `general.alignment` if set, else 32.
    fn data_alignment(&self) -> Result<u64> {
        match self.metadata.iter().find(|(k, _, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, v, _)) => v.as_u64().filter(|a| a.is_power_of_two() && *a <= 1 << 16).ok_or_else(|| {
                Error::Invalid(format!("gguf writer: general.alignment {v:?} is not a power of two <= 65536"))
            }),
        }
    }

    /// The complete file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let align = self.data_alignment()?;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        put_u32(&mut out, 3);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, self.metadata.len() as u64);
        for (key, v, elem) in &self.metadata {
            put_str(&mut out, key);
            put_u32(&mut out, type_id(v));
            put_value(&mut out, key, v, *elem)?;
        }
        // Offsets are relative to the data section, which starts at the first aligned byte
        // after the header; every tensor is padded to a multiple of the alignment.
        let align_up = |n: usize| n.div_ceil(align as usize) * align as usize;
        let mut offset = 0;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            t.dims.iter().for_each(|&d| put_u64(&mut out, d));
            put_u32(&mut out, t.ty.id());
            put_u64(&mut out, offset as u64);
            offset = align_up(offset + t.data.len());
        }
        for t in &self.tensors {
            out.resize(align_up(out.len()), 0);
            out.extend_from_slice(&t.data);
        }
        out.resize(align_up(out.len()), 0);
        Ok(out)
    }

    /// Write the file; errors name `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes().map_err(|e| Error::format(path, e.to_string()))?;
        std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
    }
}

fn not_blocks(name: &str, n: usize) -> Error {
    Error::Invalid(format!("gguf writer: tensor {name}: {n} values are not whole 32-value blocks"))
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// GGUF's metadata value type ids.
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::Str(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// The value's payload (its type id is written by the caller). Arrays must be homogeneous.
fn put_value(out: &mut Vec<u8>, key: &str, v: &MetaValue, elem: Option<u32>) -> Result<()> {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => put_u32(out, *x),
        MetaValue::I32(x) => put_u32(out, *x as u32),
        MetaValue::F32(x) => put_u32(out, x.to_bits()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::Str(s) => put_str(out, s),
        MetaValue::U64(x) => put_u64(out, *x),
        MetaValue::I64(x) => put_u64(out, *x as u64),
        MetaValue::F64(x) => put_u64(out, x.to_bits()),
        MetaValue::Array(a) => {
            let ety = elem.or_else(|| a.first().map(type_id)).unwrap_or(4);
            if let Some(bad) = a.iter().find(|e| type_id(e) != ety) {
                return Err(Error::Invalid(format!(
                    "gguf writer: metadata {key}: array of type {ety} holds a value of type {} ({bad:?})",
                    type_id(bad)
                )));
            }
            put_u32(out, ety);
            put_u64(out, a.len() as u64);
            for e in a {
                put_value(out, key, e, None)?;
            }
        }
    }
    Ok(())
}

/// ggml's reference Q8_0 (quantize_row_q8_0_ref): per 32 values d = amax/127 (stored f16),
/// q = round-half-away(x/d) using the f32 d. `None` unless `v` is whole blocks.
pub fn quantize_q8_0(v: &[f32]) -> Option<Vec<u8>> {
    if !v.len().is_multiple_of(32) {
        return None;
    }
    let mut out = Vec::with_capacity(v.len() / 32 * 34);
    for blk in v.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        out.extend(blk.iter().map(|&x| (x * id).round() as i8 as u8));
    }
    Some(out)
}

/// ggml's reference Q4_0 (quantize_row_q4_0_ref): per 32 values d = −max/8 where max is the
/// first value of largest magnitude (stored f16), q = min(15, trunc(x/d + 8.5)) using the
/// f32 d; value j and j+16 share byte j (low nibble first). `None` unless whole blocks.
pub fn quantize_q4_0(v: &[f32]) -> Option<Vec<u8>> {
    if !v.len().is_multiple_of(32) {
        return None;
    }
    let mut out = Vec::with_capacity(v.len() / 32 * 18);
    for blk in v.chunks_exact(32) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &x in blk {
            if amax < x.abs() {
                (amax, max) = (x.abs(), x);
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = |x: f32| ((x * id + 8.5) as i8).min(15) as u8;
        out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::gguf::GgufFile;

    #[test]
    fn type_ids_round_trip() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(ty.id()), Some(ty), "{}", ty.name());
        }
    }

    fn sample(align: Option<u32>) -> GgufWriter {
        let mut w = GgufWriter::new();
        w.string("general.architecture", "llama")
            .u32("llama.embedding_length", 64)
            .u64("big", u64::MAX - 3)
            .i32("neg", -7)
            .f32("llama.rope.freq_base", 10000.5)
            .bool("flag", true)
            .string_array("tokenizer.ggml.tokens", &["<s>", "a", "ü", ""])
            .i32_array("tokenizer.ggml.token_type", &[1, -2, 3])
            .f32_array("floats", &[0.5, -1.25, f32::MIN_POSITIVE])
            .string_array::<&str>("empty", &[])
            .value("nested", MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::U8(1)])]));
        if let Some(a) = align {
            w.alignment(a);
        }
        let v: Vec<f32> = (0..96).map(|i| i as f32 * 0.25 - 3.0).collect();
        w.tensor_f32("a", &[3, 32], &v).unwrap();
        w.tensor_f16("b", &[32, 3], &v).unwrap();
        w.tensor_q8_0("c", &[32, 3], &v).unwrap();
        let k: Vec<u8> = (0..2 * 210).map(|i| (i * 37 % 251) as u8).collect();
        w.tensor("d", &[256, 2], GgmlType::Q6K, k).unwrap();
        w.tensor_q4_0("e", &[96], &v).unwrap();
        w
    }

    #[test]
    fn round_trip_through_the_reader() {
        let dir = tempfile::tempdir().unwrap();
        for align in [None, Some(1), Some(64), Some(4096)] {
            let w = sample(align);
            let path = dir.path().join("t.gguf");
            w.write(&path).unwrap();
            let g = GgufFile::open(&path).unwrap();
            assert_eq!(g.version, 3);
            assert_eq!(g.alignment, align.unwrap_or(32) as usize);
            let want: Vec<_> = w.metadata.iter().map(|(k, v, _)| (k, v)).collect();
            assert_eq!(g.metadata.len(), want.len());
            for (k, v) in want {
                assert_eq!(g.get(k), Some(v), "metadata {k}");
            }
            assert_eq!(g.tensors.len(), w.tensors.len());
            for (t, p) in g.tensors.iter().zip(&w.tensors) {
                assert_eq!((&t.name, &t.dims, t.ty), (&p.name, &p.dims, p.ty));
                assert_eq!(g.data(t), &p.data[..], "tensor {}", t.name);
                assert_eq!(t.start % g.alignment, 0, "tensor {} start", t.name);
            }
        }
    }

    #[test]
    fn rejects_bad_tensors_and_metadata() {
        let mut w = GgufWriter::new();
        assert!(w.tensor_f32("x", &[4], &[0.0; 3]).is_err());
        assert!(w.tensor("x", &[48], GgmlType::Q4_0, vec![0; 27]).is_err());
        assert!(w.tensor("x", &[], GgmlType::F32, vec![]).is_err());
        assert!(w.tensor_q8_0("x", &[33], &[0.0; 33]).is_err());
        w.tensor_f32("x", &[1], &[0.0]).unwrap();
        let e = w.tensor_f32("x", &[1], &[0.0]).err().unwrap().to_string();
        assert!(e.contains("tensor x") && e.contains("twice"), "{e}");
        w.alignment(48);
        assert!(w.to_bytes().is_err());
        w.alignment(16).value("mixed", MetaValue::Array(vec![MetaValue::U8(1), MetaValue::Bool(true)]));
        let e = w.write("/nonexistent/dir/x.gguf").err().unwrap().to_string();
        assert!(e.contains("x.gguf") && e.contains("mixed"), "{e}");
    }

    #[test]
    fn setting_a_key_twice_replaces_it() {
        let mut w = GgufWriter::new();
        w.u32("k", 1).string("j", "x").u32("k", 2).u32("z", 0).remove("z");
        let keys: Vec<_> = w.metadata.iter().map(|(k, v, _)| (k.as_str(), v)).collect();
        assert_eq!(keys, [("k", &MetaValue::U32(2)), ("j", &MetaValue::Str("x".into()))]);
    }
}
