//! Batch invariance on the CPU with the real SmolLM2: a sequence's logits are the same bits
//! whether it runs alone in one call or in calls shared with other sequences, cut into
//! any chunks, its blocks anywhere in a shared store.

use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::Backend;
use ferrolm::kv::paged::{PagedKv, SeqKv};
use ferrolm::kv::{KvBlocks, Span, BLOCK};
use ferrolm::model::{Decoder, Logits};

fn model() -> (Decoder<Cpu>, Vec<Vec<u32>>) {
    let path = ferrolm::env::test_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let (mut src, tok) = ferrolm::formats::load_with_tokenizer(&path, false).unwrap();
    let m = Decoder::load(Cpu, &mut src).unwrap();
    let texts = [
        "21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,",
        "The capital of France is Paris, and the capital of Germany is",
        "Once upon a time",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Water boils at 100 degrees Celsius at sea level. At higher altitudes, water boils at",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
    ];
    let prompts = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    (m, prompts)
}

#[test]
fn logits_are_the_same_bits_alone_or_batched() {
    let (model, prompts) = model();
    let v = model.logits_width();
    // Alone: every position's logits from one call over the whole sequence.
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| model.forward(p, 0, &mut model.new_cache(p.len()).unwrap(), Logits::All).unwrap())
        .collect();
    // Batched: a shared store whose free list hands the sequences interleaved blocks; each
    // step advances every unfinished sequence by a chunk that varies by step and sequence
    // (1 to 7 rows), all in one call.
    let blocks = KvBlocks { full: 64, sliding: 0 };
    let mut store = model.backend.kv_store(&model.cfg, blocks).unwrap();
    let mut paged = PagedKv::new(BLOCK, blocks.full, None);
    let mut seqs: Vec<SeqKv> = prompts.iter().map(|_| SeqKv::default()).collect();
    let mut checked = 0;
    for step in 0.. {
        let mut plan = vec![];
        for (i, p) in prompts.iter().enumerate() {
            let len = seqs[i].len;
            if len < p.len() {
                let rows = (1 + (step * 3 + i * 5) % 7).min(p.len() - len);
                paged.reserve(&mut seqs[i], len + rows).unwrap();
                plan.push((i, len, rows));
            }
        }
        if plan.is_empty() {
            break;
        }
        let tokens: Vec<u32> = plan.iter().flat_map(|&(i, len, rows)| prompts[i][len..len + rows].to_vec()).collect();
        let spans: Vec<Span<'_>> = plan
            .iter()
            .map(|&(i, len, rows)| Span { rows, pos0: len, full: &seqs[i].full, sliding: &seqs[i].sliding })
            .collect();
        let logits = model.forward_spans(&tokens, &spans, &mut store).unwrap();
        for (&(i, len, rows), got) in plan.iter().zip(logits.chunks_exact(v)) {
            let at = len + rows - 1;
            let want = &alone[i][at * v..(at + 1) * v];
            assert!(got == want, "sequence {i}, position {at} (step {step}, {rows} rows of {})", spans.len());
            checked += 1;
        }
        for &(i, len, rows) in &plan {
            seqs[i].len = len + rows;
        }
    }
    assert!(checked > 20, "{checked} rows compared");
    // Some sequence's blocks were not consecutive in the store.
    let scattered = seqs.iter().any(|s| s.full.windows(2).any(|w| w[1] != w[0] + 1));
    assert!(scattered, "{:?}", seqs.iter().map(|s| &s.full).collect::<Vec<_>>());
}

#[test]
fn tables_that_do_not_hold_a_call_are_refused() {
    let (model, prompts) = model();
    let mut store = model.backend.kv_store(&model.cfg, KvBlocks { full: 2, sliding: 0 }).unwrap();
    let p = &prompts[0];
    let call = |spans: &[Span<'_>], store: &mut _| model.forward_spans(p, spans, store).unwrap_err().to_string();
    // A table too short, a block past the store, spans that do not cover the tokens.
    let e = call(&[Span { rows: p.len(), pos0: BLOCK, full: &[0], sliding: &[] }], &mut store);
    assert!(e.contains("block tables do not hold"), "{e}");
    let e = call(&[Span { rows: p.len(), pos0: 0, full: &[7], sliding: &[] }], &mut store);
    assert!(e.contains("block tables do not hold"), "{e}");
    let e = call(&[Span { rows: 1, pos0: 0, full: &[0], sliding: &[] }], &mut store);
    assert!(e.contains("do not cover"), "{e}");
}
