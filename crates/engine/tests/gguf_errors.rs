//! Bad GGUF files must give errors, never panics, and every error must name the file and
//! the field or tensor at fault. Each case is a file in a temp dir named after the case;
//! all cases run in this one process (a panic is caught and reported as a failure).
//!
//! Run: `cargo test -p ferrolm-engine --test gguf_errors`.

use ferrolm::formats::gguf::{GgufFile, MetaValue};
use ferrolm::formats::gguf_write::GgufWriter;
use ferrolm::quant::ggml::GgmlType;
use rand::{Rng, SeedableRng};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// A valid tiny Llama: 1 layer, hidden 64, ffn 256, vocab 8, five tensor types.
fn tiny(edit: impl FnOnce(&mut GgufWriter)) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.string("general.architecture", "llama")
        .u32("llama.embedding_length", 64)
        .u32("llama.block_count", 1)
        .u32("llama.feed_forward_length", 256)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 2)
        .u32("llama.context_length", 256)
        .f32("llama.rope.freq_base", 10000.0)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .string_array("tokenizer.ggml.tokens", &["<s>", "</s>", "a", "b", "c", "d", "e", "f"])
        .i32_array("tokenizer.ggml.token_type", &[3, 3, 1, 1, 1, 1, 1, 1])
        .string("dup.a", "x")
        .string("dup.b", "y");
    let v = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 400.0).collect() };
    w.tensor_q8_0("token_embd.weight", &[64, 8], &v(512)).unwrap();
    w.tensor_f32("output_norm.weight", &[64], &v(64)).unwrap();
    w.tensor_q4_0("blk.0.attn_q.weight", &[64, 64], &v(4096)).unwrap();
    w.tensor_f16("blk.0.attn_k.weight", &[64, 32], &v(2048)).unwrap();
    let q4k: Vec<u8> = (0..64 * 144).map(|i| (i * 131 % 251) as u8).collect();
    w.tensor("blk.0.ffn_down.weight", &[256, 64], GgmlType::Q4K, q4k).unwrap();
    w.tensor_q8_0("blk.0.ffn_up.weight", &[64, 256], &v(64 * 256)).unwrap();
    edit(&mut w);
    w.to_bytes().unwrap()
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not in file", String::from_utf8_lossy(needle)))
}

/// Byte position just after a length-prefixed string (a metadata key or tensor name).
fn after(b: &[u8], s: &str) -> usize {
    let mut needle = (s.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(s.as_bytes());
    find(b, &needle) + needle.len()
}

/// Position of a tensor info's offset field (after name, n_dims, dims, type).
fn offset_pos(b: &[u8], name: &str) -> usize {
    let p = after(b, name);
    let nd = u32::from_le_bytes(b[p..p + 4].try_into().unwrap()) as usize;
    p + 4 + 8 * nd + 4
}

fn patch(mut b: Vec<u8>, at: usize, with: &[u8]) -> Vec<u8> {
    b[at..at + with.len()].copy_from_slice(with);
    b
}

/// An outcome with the error's Display text.
type Outcome = Result<(), String>;

/// Opens with both entry points; returns (open outcome, load outcome), or a description of
/// the panic.
fn run(path: &Path) -> Result<(Outcome, Outcome), String> {
    catch_unwind(AssertUnwindSafe(|| {
        let open = GgufFile::open(path).map(|_| ()).map_err(|e| e.to_string());
        let load = ferrolm::formats::load(path, false).map(|_| ()).map_err(|e| e.to_string());
        (open, load)
    }))
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

struct Checker {
    dir: tempfile::TempDir,
    failures: Vec<String>,
    count: usize,
}

impl Checker {
    fn new() -> Self {
        Checker { dir: tempfile::tempdir().unwrap(), failures: Vec::new(), count: 0 }
    }
    fn file(&self, case: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path = self.dir.path().join(format!("{case}.gguf"));
        std::fs::write(&path, bytes).unwrap();
        path
    }
    /// `GgufFile::open` (and so `load`) must fail naming the file and every `want` string.
    fn open_err(&mut self, case: &str, bytes: &[u8], want: &[&str]) {
        let path = self.file(case, bytes);
        self.check(case, &path, want, true);
    }
    /// The file parses, but `load` must fail naming the file and every `want` string.
    fn load_err(&mut self, case: &str, bytes: &[u8], want: &[&str]) {
        let path = self.file(case, bytes);
        self.check(case, &path, want, false);
    }
    fn check(&mut self, case: &str, path: &Path, want: &[&str], open_fails: bool) {
        self.count += 1;
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        let (open, load) = match run(path) {
            Ok(r) => r,
            Err(p) => return self.failures.push(format!("{case}: PANIC {p}")),
        };
        let mut failures = Vec::new();
        let mut expect = |what: &str, r: Result<(), String>| match r {
            Ok(()) => failures.push(format!("{case}: {what} succeeded")),
            Err(m) => {
                let missing: Vec<_> =
                    std::iter::once(file.as_str()).chain(want.iter().copied()).filter(|w| !m.contains(w)).collect();
                if !missing.is_empty() {
                    failures.push(format!("{case}: {what} error {m:?} lacks {missing:?}"));
                }
            }
        };
        match open {
            _ if open_fails => expect("open", open),
            Err(m) => expect("open (must succeed)", Err(m)),
            Ok(()) => {}
        }
        expect("load", load);
        self.failures.extend(failures);
    }
    /// Any outcome but a panic is fine; an error must still name the file.
    fn no_panic(&mut self, case: &str, bytes: &[u8]) {
        self.count += 1;
        let path = self.file(case, bytes);
        match run(&path) {
            Err(p) => self.failures.push(format!("{case}: PANIC {p}")),
            Ok((open, load)) => {
                for m in [open, load].into_iter().filter_map(|r| r.err()) {
                    if !m.contains(&format!("{case}.gguf")) {
                        self.failures.push(format!("{case}: error {m:?} lacks the file"));
                    }
                }
            }
        }
    }
    fn finish(self, min_cases: usize) {
        assert!(self.count >= min_cases, "only {} cases ran", self.count);
        assert!(
            self.failures.is_empty(),
            "{} of {} cases failed:\n{}",
            self.failures.len(),
            self.count,
            self.failures.join("\n")
        );
    }
}

#[test]
fn the_base_file_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.gguf");
    std::fs::write(&path, tiny(|_| {})).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.tensors.len(), 6);
    let m = ferrolm::formats::load(&path, false).unwrap();
    assert_eq!((m.config.hidden, m.config.vocab), (64, 8));
    assert_eq!(m.tensors.len(), 6);
}

#[test]
fn bad_files_are_errors_that_name_the_file_and_field() {
    let mut c = Checker::new();
    let ok = tiny(|_| {});
    let u64max = u64::MAX.to_le_bytes();

    // Missing file: both entry points, an io error naming the path.
    let missing = c.dir.path().join("missing.gguf");
    for r in [GgufFile::open(&missing).map(|_| ()), ferrolm::formats::load(&missing, false).map(|_| ())] {
        let m = r.expect_err("missing file must fail").to_string();
        assert!(m.contains("missing.gguf"), "{m}");
    }

    c.open_err("empty", &[], &["magic", "0 bytes"]);
    c.open_err("three_bytes", b"GGU", &["magic"]);
    c.open_err("bad_magic", &patch(ok.clone(), 0, b"GGUX"), &["magic"]);
    c.open_err("json", b"{\"not\": \"gguf\"}", &["magic"]);
    for v in [0u32, 1, 4, u32::MAX] {
        let b = patch(ok.clone(), 4, &v.to_le_bytes());
        c.open_err(&format!("version_{v}"), &b, &[&format!("version {v}")]);
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let random: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
    c.open_err("random", &random, &["magic"]);

    // Absurd counts and lengths.
    c.open_err("tensor_count", &patch(ok.clone(), 8, &u64max), &["tensor count"]);
    c.open_err("kv_count", &patch(ok.clone(), 16, &u64max), &["metadata count"]);
    c.open_err("key_len", &patch(ok.clone(), 24, &u64max), &["metadata key"]);
    let arch_len = after(&ok, "general.architecture") + 4;
    let b = patch(ok.clone(), arch_len, &u64max);
    c.open_err("string_len", &b, &["metadata general.architecture"]);
    let toks = after(&ok, "tokenizer.ggml.tokens") + 8;
    let b = patch(ok.clone(), toks, &u64max);
    c.open_err("array_len", &b, &["tokenizer.ggml.tokens array length"]);
    let b = patch(ok.clone(), toks, &(1u64 << 40).to_le_bytes());
    c.open_err("array_len_2", &b, &["tokenizer.ggml.tokens array length"]);
    let name_len = after(&ok, "dup.b") + 4 + 8 + 1 + 8; // first tensor name's length
    let b = patch(ok.clone(), name_len, &u64max);
    c.open_err("tensor_name_len", &b, &["tensor name"]);
    let nd = after(&ok, "output_norm.weight");
    let b = patch(ok.clone(), nd, &1000u32.to_le_bytes());
    c.open_err("n_dims", &b, &["tensor output_norm.weight", "1000 dimensions"]);
    let b = patch(ok.clone(), nd, &0u32.to_le_bytes());
    c.open_err("n_dims_0", &b, &["tensor output_norm.weight", "0 dimensions"]);
    let d0 = after(&ok, "blk.0.attn_q.weight") + 4;
    let b = patch(ok.clone(), d0, &u64max);
    c.open_err("dims_overflow", &b, &["tensor blk.0.attn_q.weight", "bad dims"]);
    let b = patch(ok.clone(), d0, &(1u64 << 35).to_le_bytes());
    c.open_err("dims_huge", &b, &["tensor blk.0.attn_q.weight", "bad dims"]);
    let b = patch(ok.clone(), d0, &0u64.to_le_bytes());
    c.open_err("dims_zero", &b, &["tensor blk.0.attn_q.weight", "bad dims"]);

    // Tensor placement and types.
    let g = {
        let p = c.file("ok", &ok);
        GgufFile::open(p).unwrap()
    };
    let data_start = g.tensors[0].start as u64;
    let off = offset_pos(&ok, "blk.0.ffn_up.weight");
    let far = 1u64 << 30;
    for (case, o) in [
        ("offset_past_end", far),
        ("offset_max", u64::MAX - 31), // aligned: u64::MAX + 1 is a multiple of 32
        ("offset_end_overflows", (u64::MAX - data_start - 1) & !31),
    ] {
        let b = patch(ok.clone(), off, &o.to_le_bytes());
        c.open_err(case, &b, &["tensor blk.0.ffn_up.weight", "past the end"]);
    }
    let cur = u64::from_le_bytes(ok[off..off + 8].try_into().unwrap());
    let b = patch(ok.clone(), off, &(cur + 4).to_le_bytes());
    c.open_err("misaligned", &b, &["tensor blk.0.ffn_up.weight", "not aligned"]);
    let embd = after(&ok, "token_embd.weight") + 4;
    let b = patch(ok.clone(), embd, &48u64.to_le_bytes());
    c.open_err("q8_0_dims", &b, &["tensor token_embd.weight", "whole Q8_0 blocks"]);
    let down = after(&ok, "blk.0.ffn_down.weight") + 4;
    let b = patch(ok.clone(), down, &128u64.to_le_bytes());
    c.open_err("q4_k_dims", &b, &["tensor blk.0.ffn_down.weight", "whole Q4_K blocks"]);
    let ty = offset_pos(&ok, "output_norm.weight") - 4;
    for id in [99u32, 10, u32::MAX] {
        let b = patch(ok.clone(), ty, &id.to_le_bytes());
        let want = format!("ggml type {id}");
        c.open_err(&format!("type_{id}"), &b, &["tensor output_norm.weight", &want]);
    }

    // Metadata structure.
    let ctx_ty = after(&ok, "llama.context_length");
    let b = patch(ok.clone(), ctx_ty, &13u32.to_le_bytes());
    c.open_err("value_type", &b, &["metadata llama.context_length", "value type 13"]);
    let b = patch(ok.clone(), after(&ok, "general.architecture") - 1, &[0xff]);
    c.open_err("key_utf8", &b, &["metadata key", "UTF-8"]);
    let b = patch(ok.clone(), after(&ok, "dup.b") - 1, b"a");
    c.open_err("dup_key", &b, &["metadata dup.a", "twice"]);
    let k = after(&ok, "blk.0.attn_k.weight") - 8;
    let b = patch(ok.clone(), k, b"q");
    c.open_err("dup_tensor", &b, &["tensor blk.0.attn_q.weight", "twice"]);
    let nested = (0..5).fold(MetaValue::U8(1), |v, _| MetaValue::Array(vec![v]));
    let b = tiny(|w| {
        w.value("deep", nested);
    });
    c.open_err("nested", &b, &["metadata deep", "nested too deep"]);
    let b = tiny(|w| {
        w.alignment(64);
    });
    let b = patch(b.clone(), after(&b, "general.alignment") + 4, &48u32.to_le_bytes());
    c.open_err("alignment", &b, &["general.alignment"]);

    // Well-formed files the model loader must refuse.
    let b = tiny(|w| {
        w.string("general.architecture", "mamba");
    });
    c.load_err("arch", &b, &["general.architecture", "mamba"]);
    let b = tiny(|w| {
        w.remove("general.architecture");
    });
    c.load_err("no_arch", &b, &["general.architecture"]);
    let b = tiny(|w| {
        w.remove("llama.embedding_length");
    });
    c.load_err("no_embedding_length", &b, &["llama.embedding_length"]);
    let b = tiny(|w| {
        w.string("llama.block_count", "one");
    });
    c.load_err("block_count_str", &b, &["llama.block_count"]);
    let b = tiny(|w| {
        w.u32("llama.attention.head_count_kv", 3);
    });
    c.load_err("kv_heads", &b, &["n_kv_heads 3"]);

    c.finish(41);
}

/// Cut the file at every byte of its header, metadata and tensor infos, and at many points
/// of its data: each cut must fail, naming the file and the part it was reading.
#[test]
fn truncated_files_are_errors() {
    let mut c = Checker::new();
    let ok = tiny(|_| {});
    let g = GgufFile::open(c.file("ok", &ok)).unwrap();
    let infos = after(&ok, "dup.b") + 4 + 8 + 1; // end of the last metadata value
    let data = g.tensors[0].start;
    let end = g.tensors.iter().map(|t| t.start + t.len).max().unwrap();
    let mut cuts: Vec<usize> = (0..data).collect();
    cuts.extend((data..end).step_by(61));
    for t in &g.tensors {
        cuts.extend([t.start, t.start + 1, t.start + t.len - 1]);
    }
    for cut in cuts {
        let want: Vec<String> = if cut < 24 {
            let field = ["magic", "version", "tensor count", "metadata count"];
            vec![field[[0, 4, 8, 16].iter().rposition(|&s| cut >= s).unwrap()].into()]
        } else if cut < infos {
            vec!["metadata".into()]
        } else if cut < data {
            vec!["tensor".into()]
        } else {
            // The first tensor whose bytes the cut removes is the one named.
            let t = g.tensors.iter().find(|t| t.start + t.len > cut).unwrap();
            vec![format!("tensor {}", t.name), "past the end".into()]
        };
        let want: Vec<&str> = want.iter().map(|s| s.as_str()).collect();
        c.open_err(&format!("cut_{cut}"), &ok[..cut], &want);
    }
    // Cutting only the padding after the last tensor leaves a valid file.
    if end < ok.len() {
        let p = c.file("cut_padding", &ok[..end]);
        assert!(GgufFile::open(p).is_ok());
    }
    c.finish(data);
}

/// Seeded fuzzing: random bytes after a valid prefix, and random byte flips of a valid
/// file. Any result is acceptable except a panic; errors must name the file.
#[test]
fn random_corruption_never_panics() {
    let mut c = Checker::new();
    let ok = tiny(|_| {});
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    for i in 0..200 {
        let keep = rng.gen_range(4..ok.len().min(1200));
        let mut b = ok[..keep].to_vec();
        b.extend((0..rng.gen_range(0..2000)).map(|_| rng.gen::<u8>()));
        c.no_panic(&format!("tail_{i}"), &b);
    }
    for i in 0..300 {
        let mut b = ok.clone();
        for _ in 0..rng.gen_range(1..4) {
            // Mostly the header and infos, where structure lives.
            let at = if rng.gen_bool(0.8) { rng.gen_range(0..1200) } else { rng.gen_range(0..b.len()) };
            b[at] = rng.gen();
        }
        c.no_panic(&format!("flip_{i}"), &b);
    }
    c.finish(500);
}
