//! GGUF v2/v3 reader: header, metadata, tensor infos, alignment; tensor data is borrowed
//! straight from the memory map (no whole-file copies).
//!
//! Every length read from the file is checked against the bytes that remain before it is
//! used, so a corrupt file gives an error naming the field, never a huge allocation or a panic.

use crate::quant::ggml::GgmlType;
use crate::{Error, Result};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";

#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            MetaValue::U8(v) => v as u64,
            MetaValue::U16(v) => v as u64,
            MetaValue::U32(v) => v as u64,
            MetaValue::U64(v) => v,
            MetaValue::I8(v) if v >= 0 => v as u64,
            MetaValue::I16(v) if v >= 0 => v as u64,
            MetaValue::I32(v) if v >= 0 => v as u64,
            MetaValue::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] is the contiguous (input) dim.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
    /// (rows, cols) viewing the tensor as a matrix over its first dim.
    pub fn matrix_shape(&self) -> (usize, usize) {
        let cols = self.dims.first().copied().unwrap_or(1) as usize;
        (self.n_elements() / cols.max(1), cols)
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    mmap: Mmap,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, what: &str) -> Error {
        Error::format(self.path, format!("{what} (at byte {})", self.pos))
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(self.err(&format!("file truncated while reading {what}")));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    /// A count that must fit in the rest of the file at `min_each` bytes per item.
    fn count(&mut self, what: &str, min_each: usize) -> Result<usize> {
        let n = self.u64(what)?;
        self.fits(n, what, min_each)
    }
    /// Check that `n` items of at least `min_each` bytes fit in the rest of the file.
    fn fits(&self, n: u64, what: &str, min_each: usize) -> Result<usize> {
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_each as u64) > left {
            return Err(self.err(&format!("{what} = {n} is larger than the file allows")));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(&format!("{what} is not UTF-8")))
    }
    /// A metadata value of type `ty`; `what` names it in errors ("metadata <key>").
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<MetaValue> {
        let w = |s: &mut Self, n| s.take(n, what);
        Ok(match ty {
            0 => MetaValue::U8(w(self, 1)?[0]),
            1 => MetaValue::I8(w(self, 1)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(w(self, 2)?.try_into().unwrap())),
            3 => MetaValue::I16(i16::from_le_bytes(w(self, 2)?.try_into().unwrap())),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(self.u32(what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            7 => MetaValue::Bool(w(self, 1)?[0] != 0),
            8 => MetaValue::Str(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(self.err(&format!("{what}: arrays nested too deep")));
                }
                let ety = self.u32(&format!("{what} array type"))?;
                // Every element takes at least its fixed size (8 for a string's length).
                let min_each = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    _ => 1,
                };
                let n = self.count(&format!("{what} array length"), min_each)?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(ety, what, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(self.u64(what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            t => return Err(self.err(&format!("{what}: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = crate::files::open(path)?;
        // SAFETY: the map is read-only; ferrolm never writes model files while they are loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut r = Reader { buf: &mmap, pos: 0, path };
        match r.take(4, "magic") {
            Ok(m) if m == MAGIC => {}
            Ok(m) => return Err(Error::format(path, format!("not a GGUF file (bad magic {m:02x?}, want \"GGUF\")"))),
            Err(_) => {
                return Err(Error::format(path, format!("not a GGUF file (bad magic: only {} bytes)", mmap.len())))
            }
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::format(path, format!("GGUF version {version} is not supported (2 or 3)")));
        }
        // Checked against the bytes left once the metadata is read (see below), so a file
        // cut inside its metadata is reported there.
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.count("metadata count", 12)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let what = format!("metadata {key}");
            let ty = r.u32(&format!("{what} type"))?;
            let v = r.value(ty, &what, 0)?;
            if metadata.insert(key, v).is_some() {
                return Err(r.err(&format!("{what} appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a as usize,
                _ => return Err(Error::format(path, format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        // Each tensor info takes at least 32 bytes (name length 8, n_dims 4, one dim 8, type
        // 4, offset 8), so this bounds the allocation below by the file size.
        let n_tensors = r.fits(n_tensors, "tensor count", 32)?;
        let mut raw = Vec::with_capacity(n_tensors);
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let nd = r.u32(&format!("tensor {name} n_dims"))? as usize;
            if nd == 0 || nd > 4 {
                return Err(Error::format(path, format!("tensor {name}: {nd} dimensions (1..4 supported)")));
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                dims.push(r.u64(&format!("tensor {name} dims"))?);
            }
            let ty_id = r.u32(&format!("tensor {name} type"))?;
            let off = r.u64(&format!("tensor {name} offset"))?;
            if !names.insert(name.clone()) {
                return Err(r.err(&format!("tensor {name} appears twice")));
            }
            raw.push((name, dims, ty_id, off));
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(n_tensors);
        for (name, dims, ty_id, off) in raw {
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                Error::format(path, format!("tensor {name}: unknown or unsupported ggml type {ty_id}"))
            })?;
            let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n > 0 && n < 1 << 40);
            let n = n.ok_or_else(|| Error::format(path, format!("tensor {name}: bad dims {dims:?}")))? as usize;
            let len = ty.byte_size(n).filter(|_| (dims[0] as usize).is_multiple_of(ty.block().0)).ok_or_else(|| {
                Error::format(path, format!("tensor {name}: dims {dims:?} are not whole {} blocks", ty.name()))
            })?;
            if off % alignment as u64 != 0 {
                return Err(Error::format(path, format!("tensor {name}: offset {off} is not aligned to {alignment}")));
            }
            // Checked: an absurd offset must not overflow (a panic in debug builds).
            let start = (data_start as u64)
                .checked_add(off)
                .filter(|s| s.checked_add(len as u64).is_some_and(|e| e <= mmap.len() as u64));
            let start = start.ok_or_else(|| {
                Error::format(
                    path,
                    format!("tensor {name}: data [{off}, +{len}) runs past the end of the file ({} bytes)", mmap.len()),
                )
            })? as usize;
            tensors.push(TensorInfo { name, dims, ty, start, len });
        }
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, alignment, mmap })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[t.start..t.start + t.len]
    }
    /// Tell the kernel we are done with a tensor's pages, so import does not hold the file
    /// and its converted copy resident at once (keeps peak RSS near one model size).
    pub fn release(&self, t: &TensorInfo) {
        self.release_range(t.start, t.start + t.len);
    }

    /// Drop the tokenizer's metadata (tens of thousands of strings) and the header's pages
    /// once a tokenizer has been built from them, before the weights are imported.
    pub fn forget_tokenizer(&mut self) {
        self.metadata.retain(|k, _| !k.starts_with("tokenizer.ggml."));
        let header_end = self.tensors.iter().map(|t| t.start).min().unwrap_or(0);
        self.release_range(0, header_end);
    }

    fn release_range(&self, start: usize, end: usize) {
        let page = 4096;
        let s = start.div_ceil(page) * page;
        let e = end / page * page;
        if e > s {
            // SAFETY: private read-only file mapping; dropped pages are re-read from the file.
            let _ = unsafe { self.mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, s, e - s) };
        }
    }
    pub fn file_size(&self) -> usize {
        self.mmap.len()
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
    fn missing(&self, key: &str, what: &str) -> Error {
        Error::format(&self.path, format!("metadata {key}: missing or not {what}"))
    }
    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.get(key).and_then(|v| v.as_u64()).ok_or_else(|| self.missing(key, "an integer"))
    }
    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.get(key).and_then(|v| v.as_str()).ok_or_else(|| self.missing(key, "a string"))
    }
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|v| v.as_u64().ok_or_else(|| self.missing(key, "an integer"))).transpose()
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| self.missing(key, "a number"))).transpose()
    }
    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(|v| v.as_bool())
    }
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        let a = self.get(key).and_then(|v| v.as_array()).ok_or_else(|| self.missing(key, "an array"))?;
        a.iter().map(|v| v.as_str().ok_or_else(|| self.missing(key, "an array of strings"))).collect()
    }
}
