//! Batch invariance on CUDA: the serving engine's calls (`Decoder::forward_spans`) give a
//! sequence the same logits bits alone, one row a call, or batched with other sequences in
//! any chunks, its blocks anywhere in a shared store; and those logits agree with the CPU's.

use super::models::smollm2;
use ferrolm::backend::Backend;
use ferrolm::kv::paged::{PagedKv, SeqKv};
use ferrolm::kv::{KvBlocks, Span, BLOCK};
use ferrolm::model::Decoder;

/// Every position's logits of each prompt through forward_spans, in the calls `plan` makes:
/// (step, sequence, rows left) -> rows this call (0: not in it).
fn run<B: Backend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    plan: impl Fn(usize, usize, usize) -> usize,
) -> Vec<Vec<f32>> {
    let v = model.logits_width();
    let blocks = KvBlocks { full: 64, sliding: 0 };
    let mut store = model.backend.kv_store(&model.cfg, blocks).unwrap();
    let mut paged = PagedKv::new(BLOCK, blocks.full, None);
    let mut seqs: Vec<SeqKv> = prompts.iter().map(|_| SeqKv::default()).collect();
    let mut out: Vec<Vec<f32>> = prompts.iter().map(|p| vec![f32::NAN; p.len() * v]).collect();
    for step in 0.. {
        let mut call = vec![];
        for (i, p) in prompts.iter().enumerate() {
            let len = seqs[i].len;
            let rows = plan(step, i, p.len() - len).min(p.len() - len);
            if rows > 0 {
                paged.reserve(&mut seqs[i], len + rows).unwrap();
                call.push((i, len, rows));
            }
        }
        if call.is_empty() {
            if seqs.iter().zip(prompts).all(|(s, p)| s.len == p.len()) {
                break;
            }
            continue;
        }
        let tokens: Vec<u32> = call.iter().flat_map(|&(i, len, rows)| prompts[i][len..len + rows].to_vec()).collect();
        let spans: Vec<Span<'_>> = call
            .iter()
            .map(|&(i, len, rows)| Span { rows, pos0: len, full: &seqs[i].full, sliding: &seqs[i].sliding })
            .collect();
        let logits = model.forward_spans(&tokens, &spans, &mut store).unwrap();
        for (&(i, len, rows), row) in call.iter().zip(logits.chunks_exact(v)) {
            let at = len + rows - 1;
            out[i][at * v..(at + 1) * v].copy_from_slice(row);
            seqs[i].len = len + rows;
        }
    }
    out
}

#[test]
fn batched_calls_give_the_same_bits_as_one_row_calls() {
    let (mc, mg, tok) = smollm2();
    let texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "1, 2, 3, 4, 5, 6, 7, 8, 9,"];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let v = mg.logits_width();
    // One row a call, one sequence at a time: every position's logits.
    let alone = run(&mg, &prompts, |step, i, _| usize::from(step >= 64 * i));
    // All together, chunks of 1..5 rows varying by step and sequence: only each chunk's last
    // row is known; it must equal the one-row calls' bits.
    let batched = run(&mg, &prompts, |step, i, _| 1 + (step * 3 + i * 5) % 5);
    let mut compared = 0;
    for (a, b) in alone.iter().zip(&batched) {
        for (ra, rb) in a.chunks_exact(v).zip(b.chunks_exact(v)) {
            if rb[0].is_nan() {
                continue;
            }
            assert!(ra == rb, "a batched row differs from its one-row call");
            compared += 1;
        }
    }
    assert!(compared >= 6, "{compared} rows compared");
    // And against the CPU (the same calls): the argmax agrees at ≥ 90% of positions (bf16
    // activations against f32; the model parity tests hold the tighter bar).
    let cpu = run(&mc, &prompts, |step, i, _| usize::from(step >= 64 * i));
    let (mut agree, mut n) = (0, 0);
    for (g, c) in alone.iter().zip(&cpu) {
        for (rg, rc) in g.chunks_exact(v).zip(c.chunks_exact(v)) {
            agree += usize::from(ferrolm::sample::argmax(rg) == ferrolm::sample::argmax(rc));
            n += 1;
        }
    }
    assert!(agree * 10 >= n * 9, "argmax agrees at {agree} of {n} positions");
}
