//! Reading input files safely. Only regular files are read: a FIFO blocks on open and
//! never ends, a device such as /dev/zero never ends, and a directory is not a file; each
//! is refused with an error naming the path, before anything is opened. Text inputs
//! (configs, indexes, tokenizers, templates, `--file`) are read up to a size limit.

use crate::{Error, Result};
use std::io::Read;
use std::path::Path;

/// Most bytes of a text input (config.json, an index, tokenizer.json, a template, a
/// `--file`): far above any real one (Qwen's tokenizer.json is 7 MB).
pub const TEXT_LIMIT: u64 = 256 << 20;

/// `s` with control characters escaped (`\u{1b}`): names and messages that come from files
/// are printed, and an escape sequence or a newline in them must not reach the terminal raw.
pub fn printable(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// `path` is a regular file (symlinks followed); else an error naming what it is.
pub fn check_regular(path: &Path) -> Result<std::fs::Metadata> {
    let m = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if m.is_file() {
        return Ok(m);
    }
    let what = if m.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
    Err(Error::format(path, format!("{what}: ferrolm reads regular files only")))
}

/// Open a regular file for reading.
pub fn open(path: &Path) -> Result<std::fs::File> {
    check_regular(path)?;
    std::fs::File::open(path).map_err(|e| Error::io(path, e))
}

/// The bytes of a regular file of at most `limit` bytes.
pub fn read(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let len = check_regular(path)?.len();
    if len > limit {
        return Err(Error::format(path, format!("{len} bytes, more than the {limit} a text input may have")));
    }
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::with_capacity(len as usize);
    // take(): the file may have grown since its size was read.
    f.take(limit + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(Error::format(path, format!("more than the {limit} bytes a text input may have")));
    }
    Ok(bytes)
}

/// A UTF-8 text file of at most `TEXT_LIMIT` bytes.
pub fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read(path, TEXT_LIMIT)?).map_err(|_| Error::format(path, "not UTF-8 text"))
}

/// `read_text`, or None where the file does not exist.
pub fn read_text_if_present(path: &Path) -> Result<Option<String>> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => read_text(path).map(Some),
    }
}
