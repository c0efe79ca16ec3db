//! Batch invariance on the CPU with the real SmolLM2: a sequence's logits are the same bits
//! whether it runs alone in one call or in calls shared with other sequences, cut into
//! any chunks, its blocks anywhere in a shared store.

use ferrolm::backend::cpu::Cpu;
use ferrolm::backend::Backend;
use ferrolm::kv::paged::{PagedKv, SeqKv};
use ferrolm::kv::{KvBlocks, Span, BLOCK};
use ferrolm::model::{Decoder, Logits, RowOut};

fn load(file: &str) -> (Decoder<Cpu>, ferrolm::tokenizer::Tokenizer) {
    let path = ferrolm::env::test_models_dir().join(file);
    let (mut src, tok) = ferrolm::formats::load_with_tokenizer(&path, false).unwrap();
    (Decoder::load(Cpu, &mut src).unwrap(), tok)
}

fn model() -> (Decoder<Cpu>, Vec<Vec<u32>>) {
    let (m, tok) = load("SmolLM2-135M-Instruct.Q4_1.gguf");
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

/// Run `prompts` together through a shared store of `blocks`, each step advancing every
/// unfinished sequence by a chunk that varies by step and sequence (1 to `max_rows` rows),
/// all in one call, and check each call's logits against `alone` (every position's logits
/// of each prompt run by itself); every other row asks only for its argmax, which must be
/// `alone`'s. Returns the rows compared and the sequences' tables.
fn run_batched<B: Backend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    alone: &[Vec<f32>],
    blocks: KvBlocks,
    max_rows: usize,
) -> (usize, Vec<SeqKv>) {
    let v = model.logits_width();
    let mut store = model.backend.kv_store(&model.cfg, blocks).unwrap();
    let sliding = (blocks.sliding > 0).then_some((blocks.sliding, model.cfg.sliding_window));
    let mut paged = PagedKv::new(BLOCK, blocks.full, sliding);
    let mut seqs: Vec<SeqKv> = prompts.iter().map(|_| SeqKv::default()).collect();
    let mut checked = 0;
    for step in 0.. {
        let mut plan = vec![];
        for (i, p) in prompts.iter().enumerate() {
            let len = seqs[i].len;
            if len < p.len() {
                let rows = (1 + (step * 3 + i * 5) % max_rows).min(p.len() - len);
                paged.reserve(&mut seqs[i], len + rows).unwrap();
                plan.push((i, len, rows));
            }
        }
        if plan.is_empty() {
            break;
        }
        let tokens: Vec<u32> = plan.iter().flat_map(|&(i, len, rows)| prompts[i][len..len + rows].to_vec()).collect();
        let spans: Vec<Span<'_>> = plan.iter().map(|&(i, _, rows)| seqs[i].span(rows)).collect();
        let want_logits: Vec<bool> = plan.iter().map(|&(i, ..)| (step + i) % 2 == 0).collect();
        let outs = model.forward_spans_out(&tokens, &spans, &mut store, &want_logits).unwrap();
        for (&(i, len, rows), got) in plan.iter().zip(outs) {
            let at = len + rows - 1;
            let want = &alone[i][at * v..(at + 1) * v];
            let what = format!("sequence {i}, position {at} (step {step}, {rows} rows of {})", spans.len());
            match got {
                RowOut::Logits(l) => assert!(l == want, "{what}: logits differ"),
                RowOut::Token(t) => assert_eq!(t, ferrolm::sample::argmax(want), "{what}: argmax differs"),
            }
            checked += 1;
        }
        for &(i, len, rows) in &plan {
            seqs[i].len = len + rows;
        }
    }
    (checked, seqs)
}

/// Every position's logits of each prompt, run alone in one call.
fn alone(model: &Decoder<Cpu>, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    prompts.iter().map(|p| model.forward(p, 0, &mut model.new_cache(p.len()).unwrap(), Logits::All).unwrap()).collect()
}

#[test]
fn logits_are_the_same_bits_alone_or_batched() {
    let (model, prompts) = model();
    let alone = alone(&model, &prompts);
    let (checked, seqs) = run_batched(&model, &prompts, &alone, KvBlocks { full: 64, sliding: 0, head: 0 }, 7);
    assert!(checked > 20, "{checked} rows compared");
    // Some sequence's blocks were not consecutive in the store.
    let scattered = seqs.iter().any(|s| s.full.windows(2).any(|w| w[1] != w[0] + 1));
    assert!(scattered, "{:?}", seqs.iter().map(|s| &s.full).collect::<Vec<_>>());
}

/// The same over two simulated tensor-parallel ranks (backend::sharded): batched calls of
/// the sharded model give the bits the whole model gives each sequence alone.
#[test]
fn a_tensor_parallel_model_batches_as_the_whole_one_runs_alone() {
    use ferrolm::backend::sharded::{InOrder, Sharded};
    let (whole, prompts) = model();
    let alone = alone(&whole, &prompts);
    let path = ferrolm::env::test_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut src = ferrolm::formats::load(&path, false).unwrap();
    let backend = Sharded::new(vec![Cpu, Cpu], &src.config, InOrder).unwrap();
    let tp = Decoder::load(backend, &mut src).unwrap();
    let (checked, _) = run_batched(&tp, &prompts, &alone, KvBlocks { full: 64, sliding: 0, head: 0 }, 7);
    assert!(checked > 20, "{checked} rows compared");
}

/// Gemma 3 270M's sliding layers: sequences past the window, their sliding blocks given
/// back as they grow and reused by the others, give the same bits as alone (where every
/// position stays in the cache). The window is cut to 64 (it is read at run time) so that
/// 256-token prompts pass it four times over (at its own 512, prompts of 700 took 33 s here
/// against 11, most of it the 262k-row head over every position of the runs alone).
#[test]
fn sliding_window_blocks_given_back_change_no_bit() {
    let (mut model, tok) = load("gemma-3-270m-q4_k_m.gguf");
    model.cfg.sliding_window = 64;
    let text = "The river flows north through three towns, each with its own bridge and market. ";
    let prompts: Vec<Vec<u32>> =
        (0..2).map(|i| tok.encode(&format!("Story {i}. {}", text.repeat(20)), true).unwrap()[..256].to_vec()).collect();
    let alone = alone(&model, &prompts);
    // Sliding blocks for two windows and a step each: blocks must go back to fit.
    let max_rows = 16;
    let per_seq = (model.cfg.sliding_window + max_rows).div_ceil(BLOCK) + 1;
    let blocks = KvBlocks { full: 48, sliding: 2 * per_seq, head: 0 };
    let (checked, seqs) = run_batched(&model, &prompts, &alone, blocks, max_rows);
    assert!(checked > 30, "{checked} rows compared");
    let released = seqs.iter().all(|s| s.sliding.contains(&ferrolm::kv::paged::NO_BLOCK));
    assert!(released, "sliding blocks given back");
}

#[test]
fn tables_that_do_not_hold_a_call_are_refused() {
    let (model, prompts) = model();
    let mut store = model.backend.kv_store(&model.cfg, KvBlocks { full: 2, sliding: 0, head: 0 }).unwrap();
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
