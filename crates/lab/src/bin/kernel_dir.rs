//! Writes a lab kernel variant as a `FERROLM_KERNEL_DIR` directory, whose files replace the
//! engine's of the same name (no GPU needed: run it here, carry the directory):
//!
//!   usage: kernel_dir attn-mma DIR
//!
//! attn-mma: DIR/attention_decode.cuh, the engine's with the tensor-core loop over the bf16
//! cache spliced in (kernels/attn_mma.cuh; it runs where `FERROLM_ATTN_QB=4` gives a block
//! 2-4 query heads). Exits 2 on bad arguments, 1 when the file cannot be written.

const USAGE: &str = "usage: kernel_dir attn-mma DIR";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [variant, dir] = &args[..] else {
        eprintln!("{USAGE}");
        std::process::exit(2)
    };
    let (name, text) = match variant.as_str() {
        "attn-mma" => ("attention_decode.cuh", ferrolm_lab::kernels::attn_mma_header()),
        _ => {
            eprintln!("kernel_dir: no variant {variant:?}\n{USAGE}");
            std::process::exit(2)
        }
    };
    let path = std::path::Path::new(dir).join(name);
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, text)) {
        eprintln!("kernel_dir: {}: {e}", path.display());
        std::process::exit(1);
    }
    println!("{}", path.display());
}
