//! KV files: one sequence's cache on disk (`--prompt-cache FILE`, a persisted prefix cache).
//!
//! A file is the 8-byte magic, the header's length (u32 LE), the header (JSON), the payload,
//! and a CRC-32 of header and payload (u32 LE). The header names the model (a fingerprint),
//! the KV scheme and its group sizes, the positions kept unquantized, the token ids whose
//! cache the payload holds, the payload's layout and its length. Writes are atomic: a
//! temporary file in the same directory, synced, then renamed over the target. A read
//! refuses a file of another model, scheme or layout by name, and detects a truncated or
//! corrupt one before returning anything; a missing file is not an error (None).

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

const MAGIC: &[u8; 8] = b"FERROKV\x01";
const VERSION: u32 = 1;
/// Largest header accepted: token ids of a long context and the rest.
const MAX_HEADER: usize = 64 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvFileHeader {
    pub version: u32,
    /// The model fingerprint (weights' metadata and tokenizer).
    pub model: String,
    /// The KV scheme (`KvScheme`'s name).
    pub scheme: String,
    pub key_group: usize,
    pub value_group: usize,
    /// Positions kept unquantized at the start (`--kv-start`).
    pub kv_start: usize,
    /// The tokens whose cache the payload holds.
    pub tokens: Vec<u32>,
    /// What the payload holds, as its writer describes it (layers, heads, row bytes).
    pub layout: String,
    pub payload_bytes: u64,
}

impl KvFileHeader {
    pub fn new(
        model: &str,
        scheme: &str,
        groups: (usize, usize),
        kv_start: usize,
        tokens: Vec<u32>,
        layout: &str,
    ) -> Self {
        KvFileHeader {
            version: VERSION,
            model: model.into(),
            scheme: scheme.into(),
            key_group: groups.0,
            value_group: groups.1,
            kv_start,
            tokens,
            layout: layout.into(),
            payload_bytes: 0,
        }
    }
}

/// What a reader needs the file to be.
pub struct Expect<'a> {
    pub model: &'a str,
    pub scheme: &'a str,
    pub layout: &'a str,
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Invalid(format!("KV file {}: {what}: {e}", path.display()))
}

/// Write `payload` under `header` to `path` atomically (the header's payload length is set).
pub fn write(path: &Path, header: &KvFileHeader, payload: &[u8]) -> Result<()> {
    let header = KvFileHeader { payload_bytes: payload.len() as u64, ..header.clone() };
    let json = serde_json::to_vec(&header).map_err(|e| Error::Invalid(format!("KV file header: {e}")))?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&json);
    crc.update(payload);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name =
        path.file_name().ok_or_else(|| Error::Invalid(format!("KV file {}: not a file name", path.display())))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&(json.len() as u32).to_le_bytes())?;
        f.write_all(&json)?;
        f.write_all(payload)?;
        f.write_all(&crc.finalize().to_le_bytes())?;
        f.sync_all()
    })();
    if let Err(e) = written.and_then(|_| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, "writing", e));
    }
    // The rename is durable once the directory is synced (not possible on every platform).
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The header of the file at `path` alone (its payload and checksum unread: `read` checks
/// them), for an index of many files.
pub fn read_header(path: &Path) -> Result<KvFileHeader> {
    use std::io::Read;
    let bad = |why: String| Error::Invalid(format!("KV file {}: {why}", path.display()));
    let mut f = std::fs::File::open(path).map_err(|e| io_err(path, "reading", e))?;
    let mut head = [0u8; 12];
    f.read_exact(&mut head).map_err(|_| bad("too short".into()))?;
    if &head[..8] != MAGIC {
        return Err(bad("not a ferrolm KV file (bad magic)".into()));
    }
    let hlen = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    if hlen > MAX_HEADER {
        return Err(bad(format!("a header of {hlen} bytes")));
    }
    let mut json = vec![0u8; hlen];
    f.read_exact(&mut json).map_err(|_| bad("truncated header".into()))?;
    serde_json::from_slice(&json).map_err(|e| bad(format!("corrupt header: {e}")))
}

/// Read the file at `path` if there is one; an error names what is wrong with it.
pub fn read(path: &Path, expect: &Expect<'_>) -> Result<Option<(KvFileHeader, Vec<u8>)>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path, "reading", e)),
    };
    let bad = |why: String| Error::Invalid(format!("KV file {}: {why}; not loaded", path.display()));
    if bytes.len() < 16 || &bytes[..8] != MAGIC {
        return Err(bad("not a ferrolm KV file (bad magic or too short)".into()));
    }
    let hlen = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize;
    if hlen > MAX_HEADER || 12 + hlen + 4 > bytes.len() {
        return Err(bad(format!("truncated: {} bytes, its header alone claims {hlen}", bytes.len())));
    }
    let header: KvFileHeader =
        serde_json::from_slice(&bytes[12..12 + hlen]).map_err(|e| bad(format!("corrupt header: {e}")))?;
    let want = usize::try_from(header.payload_bytes).ok().and_then(|p| p.checked_add(12 + hlen + 4));
    if want != Some(bytes.len()) {
        let want = want.map_or("more than fits in memory".to_string(), |w| w.to_string());
        return Err(bad(format!("truncated or padded: {} bytes where its header says {want}", bytes.len())));
    }
    let (body, tail) = bytes[12..].split_at(bytes.len() - 16);
    let stored = u32::from_le_bytes(tail.try_into().expect("4 bytes"));
    if crc32fast::hash(body) != stored {
        return Err(bad("corrupt: its checksum does not match its contents".into()));
    }
    if header.version != VERSION {
        return Err(bad(format!("version {} (this build reads {VERSION})", header.version)));
    }
    if header.model != expect.model {
        return Err(bad(format!("made for another model (fingerprint {}, this one's {})", header.model, expect.model)));
    }
    if header.scheme != expect.scheme {
        return Err(bad(format!("holds a {} cache, not {}", header.scheme, expect.scheme)));
    }
    if header.layout != expect.layout {
        return Err(bad(format!("its layout is {:?}, this model's {:?}", header.layout, expect.layout)));
    }
    let payload = body[hlen..].to_vec();
    Ok(Some((header, payload)))
}

/// A model's fingerprint for KV files: a CRC-32 over its configuration and every tensor's
/// name, shape, format and size, and one over its tokenizer's tokens and special ids, as
/// 16 hex digits. Two loads of one file agree; another quantization, shape or tokenizer
/// differs. (Two checkpoints of one architecture and format share the first half; the
/// file's header still holds the token ids its cache came from.)
pub fn model_fingerprint(src: &crate::formats::ModelSource, tok: &crate::tokenizer::Tokenizer) -> String {
    let mut meta = crc32fast::Hasher::new();
    meta.update(format!("{:?}", src.config).as_bytes());
    let mut names: Vec<&String> = src.tensors.keys().collect();
    names.sort();
    for n in names {
        let w = &src.tensors[n];
        meta.update(format!("{n} {}x{} {} {}\n", w.rows(), w.cols(), w.describe(), w.byte_size()).as_bytes());
    }
    let mut toks = crc32fast::Hasher::new();
    toks.update(format!("{:?} {:?} {:?}\n", tok.bos_id(), tok.eos_id(), tok.stop_ids()).as_bytes());
    let hf = tok.hf();
    for id in 0..tok.vocab_size() as u32 {
        toks.update(hf.id_to_token(id).unwrap_or_default().as_bytes());
        toks.update(b"\0");
    }
    format!("{:08x}{:08x}", meta.finalize(), toks.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (KvFileHeader, Vec<u8>) {
        let h = KvFileHeader::new("m1", "turbo:k8v3", (32, 32), 0, vec![1, 2, 3], "30 layers x 3 heads x 100 B");
        (h, (0..1000u32).map(|i| (i * 31 % 251) as u8).collect())
    }

    fn expect() -> Expect<'static> {
        Expect { model: "m1", scheme: "turbo:k8v3", layout: "30 layers x 3 heads x 100 B" }
    }

    #[test]
    fn a_written_file_reads_back_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.kv");
        assert!(read(&path, &expect()).unwrap().is_none(), "a missing file is not an error");
        let (h, payload) = sample();
        write(&path, &h, &payload).unwrap();
        write(&path, &h, &payload).unwrap(); // over an existing file
        let (got, data) = read(&path, &expect()).unwrap().unwrap();
        assert_eq!((got.tokens.clone(), got.payload_bytes), (vec![1, 2, 3], 1000));
        assert_eq!(data, payload);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn damaged_or_foreign_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.kv");
        let (h, payload) = sample();
        write(&path, &h, &payload).unwrap();
        let good = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8], e: &Expect<'_>| {
            std::fs::write(&path, bytes).unwrap();
            read(&path, e).unwrap_err().to_string()
        };
        assert!(refused(&good[..good.len() - 10], &expect()).contains("truncated"));
        assert!(refused(&good[..20], &expect()).contains("truncated"));
        let mut flipped = good.clone();
        flipped[good.len() - 100] ^= 1;
        assert!(refused(&flipped, &expect()).contains("checksum"));
        assert!(refused(b"GGUF and more bytes", &expect()).contains("not a ferrolm KV file"));
        let huge = serde_json::to_vec(&KvFileHeader { payload_bytes: u64::MAX, ..h.clone() }).unwrap();
        let mut lying = MAGIC.to_vec();
        lying.extend((huge.len() as u32).to_le_bytes());
        lying.extend(&huge);
        lying.extend([0u8; 4]);
        assert!(refused(&lying, &expect()).contains("truncated"));
        let other = Expect { model: "m2", ..expect() };
        assert!(refused(&good, &other).contains("another model"));
        let other = Expect { scheme: "bf16", ..expect() };
        assert!(refused(&good, &other).contains("turbo:k8v3"));
        let other = Expect { layout: "x", ..expect() };
        assert!(refused(&good, &other).contains("layout"));
    }
}
