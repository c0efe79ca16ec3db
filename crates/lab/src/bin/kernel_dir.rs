//! Writes a lab kernel variant as a `FERROLM_KERNEL_DIR` directory, whose files replace the
//! engine's of the same name (no GPU needed: run it here, carry the directory):
//!
//!   usage: kernel_dir attn-mma DIR [--blocks N] [NAME=VALUE]...
//!
//! attn-mma: DIR/attention_decode.cuh, the engine's with the tensor-core loop over the bf16
//! cache spliced in (kernels/attn_mma.cuh; it runs where `FERROLM_ATTN_QB=4` gives a block
//! 2-4 query heads), each NAME=VALUE a `#define` before it (e.g. ATT_MMA_SPLIT_LOADS=0);
//! with --blocks N also DIR/attention_decode.cu, its blocks-per-SM bound N instead of 3.
//! Exits 2 on bad arguments, 1 when a file cannot be written.

const USAGE: &str = "usage: kernel_dir attn-mma DIR [--blocks N] [NAME=VALUE]...";

fn bad(msg: &str) -> ! {
    eprintln!("kernel_dir: {msg}\n{USAGE}");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [variant, dir, rest @ ..] = &args[..] else { bad("a variant and a directory") };
    if variant != "attn-mma" {
        bad(&format!("no variant {variant:?}"));
    }
    let (mut blocks, mut defines, mut it) = (None, String::new(), rest.iter());
    while let Some(a) = it.next() {
        match a.split_once('=') {
            _ if a == "--blocks" => match it.next().and_then(|n| n.parse::<u32>().ok()) {
                Some(n @ 1..=8) => blocks = Some(n),
                _ => bad("--blocks takes 1 to 8"),
            },
            Some((name, value)) if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') => {
                defines += &format!("#define {name} {value}\n");
            }
            _ => bad(&format!("unknown argument {a:?}")),
        }
    }
    let mut files = vec![("attention_decode.cuh", defines + ferrolm_lab::kernels::attn_mma_header())];
    if let Some(n) = blocks {
        files.push(("attention_decode.cu", ferrolm_lab::kernels::attn_mma_kernel(n)));
    }
    for (name, text) in files {
        let path = std::path::Path::new(dir).join(name);
        if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, text)) {
            eprintln!("kernel_dir: {}: {e}", path.display());
            std::process::exit(1);
        }
        println!("{}", path.display());
    }
}
