fn rss() -> String {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().filter(|l| l.starts_with("VmRSS") || l.starts_with("VmHWM")).collect::<Vec<_>>().join(" ")
}
fn main() {
    let p = std::path::PathBuf::from(std::env::args().nth(1).unwrap());
    println!("start {}", rss());
    let g = ferrolm::formats::gguf::GgufFile::open(&p).unwrap();
    println!("gguf open {}", rss());
    let t = ferrolm::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    println!("tokenizer {}", rss());
    drop(g);
    println!("drop gguf {}", rss());
    let src = ferrolm::formats::load(&p, false).unwrap();
    println!("model {}", rss());
    drop(t);
    println!("drop tok {}", rss());
    drop(src);
}
