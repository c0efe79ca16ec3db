use ferrolm::backend::cpu::Cpu;
use ferrolm::model::{Llama, Logits};
fn main() {
    let p = std::env::args().nth(1).unwrap();
    let t = std::time::Instant::now();
    let mut src = ferrolm::formats::load(std::path::Path::new(&p), false).unwrap();
    let model = Llama::load(Cpu, &mut src).unwrap();
    println!("load {:?}", t.elapsed());
    let mut kv = model.new_cache(256).unwrap();
    let toks = [504u32, 3575, 282, 4649, 314];
    let t = std::time::Instant::now();
    let l = model.forward(&toks, 0, &mut kv, Logits::Last).unwrap();
    println!("prefill {:?}", t.elapsed());
    let mut next = ferrolm::sample::argmax(&l);
    let mut out = vec![next];
    let t = std::time::Instant::now();
    for i in 0..20 {
        let l = model.forward(&[next], toks.len() + i, &mut kv, Logits::Last).unwrap();
        next = ferrolm::sample::argmax(&l);
        out.push(next);
    }
    println!("decode 20 {:?}", t.elapsed());
    println!("{out:?}");
}
