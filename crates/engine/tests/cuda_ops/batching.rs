//! Batch invariance on CUDA: the serving engine's calls (`Decoder::forward_spans`) give a
//! sequence the same logits bits alone, one row a call, or batched with other sequences in
//! any chunks, its blocks anywhere in a shared store, from captured calls or launched ones;
//! and those logits agree with the CPU's.

use super::models::smollm2;
use super::smollm2_cuda;
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::backend::Backend;
use ferrolm::kv::paged::{PagedKv, SeqKv};
use ferrolm::kv::{KvBlocks, Span, BLOCK};
use ferrolm::model::{Decoder, RowOut};

/// Every position's logits of each prompt through forward_spans, in the calls `plan` makes:
/// (step, sequence, rows left) -> rows this call (0: not in it).
fn run<B: Backend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    plan: impl Fn(usize, usize, usize) -> usize,
) -> Vec<Vec<f32>> {
    run_counted(model, prompts, plan).0
}

/// `run`, and the number of forward calls it made.
fn run_counted<B: Backend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    plan: impl Fn(usize, usize, usize) -> usize,
) -> (Vec<Vec<f32>>, usize) {
    let v = model.logits_width();
    let blocks = KvBlocks { full: 64, sliding: 0, head: 0 };
    let mut store = model.backend.kv_store_scheme(&model.cfg, blocks, model.kv_scheme()).unwrap();
    let mut paged = PagedKv::new(BLOCK, blocks.full, None);
    let mut seqs: Vec<SeqKv> = prompts.iter().map(|_| SeqKv::default()).collect();
    let mut out: Vec<Vec<f32>> = prompts.iter().map(|p| vec![f32::NAN; p.len() * v]).collect();
    let mut calls = 0;
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
        let spans: Vec<Span<'_>> = call.iter().map(|&(i, _, rows)| seqs[i].span(rows)).collect();
        let logits = model.forward_spans(&tokens, &spans, &mut store).unwrap();
        calls += 1;
        for (&(i, len, rows), row) in call.iter().zip(logits.chunks_exact(v)) {
            let at = len + rows - 1;
            out[i][at * v..(at + 1) * v].copy_from_slice(row);
            seqs[i].len = len + rows;
        }
    }
    (out, calls)
}

/// Every row `batched` knows (the last of each chunk; the others NaN) is the bits of the
/// same row in `alone`; returns how many were compared.
fn rows_equal(alone: &[Vec<f32>], batched: &[Vec<f32>], v: usize, what: &str) -> usize {
    let mut compared = 0;
    for (a, b) in alone.iter().zip(batched) {
        for (ra, rb) in a.chunks_exact(v).zip(b.chunks_exact(v)) {
            if rb[0].is_nan() {
                continue;
            }
            assert!(ra == rb, "{what}: a batched row differs from its one-row call");
            compared += 1;
        }
    }
    compared
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
    let compared = rows_equal(&alone, &batched, v, "bf16");
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

/// A quantized cache keeps batch invariance: in turbo:k8v3 and affine:4 rows, each
/// sequence's logits are the same bits one row a call alone and batched with others in
/// chunks of 1-5 rows (decode over quantized rows, and prefill chunks over a quantized
/// prefix), for sequences ending short of, on and past a block's end (33, 47, 64 positions).
#[test]
fn quantized_caches_give_the_same_bits_alone_and_batched() {
    let (_, mut mg, tok) = smollm2();
    let text = "The river flows north through three towns. Each town has a bridge, a market and a \
                school; the first town also has a mill that grinds the grain of the whole valley, \
                and its people trade flour for wool and timber with the towns downstream. In \
                spring the river floods the lower fields, so the farmers plant late and harvest \
                in the first cold weeks of autumn, when the roads are dry again.";
    let ids = tok.encode(text, true).unwrap();
    assert!(ids.len() >= 64, "{} tokens", ids.len());
    let prompts: Vec<Vec<u32>> = [33, 47, 64].iter().map(|&n| ids[..n].to_vec()).collect();
    let v = mg.logits_width();
    for scheme in ["turbo:k8v3", "affine:4"] {
        mg.set_kv_scheme(ferrolm::kv::scheme::KvScheme::parse(scheme).unwrap()).unwrap();
        let alone = run(&mg, &prompts, |step, i, _| usize::from(step >= 100 * i));
        let batched = run(&mg, &prompts, |step, i, _| 1 + (step * 3 + i * 5) % 5);
        let compared = rows_equal(&alone, &batched, v, scheme);
        assert!(compared >= 30, "{scheme}: {compared} rows compared");
    }
}

/// Calls replayed from graphs captured per padded size give the bits of calls launched
/// kernel by kernel (`call_graphs` off), each size is captured once and replayed after, and
/// a call past the captured sizes (more than 64 rows) runs launched with the same bits.
#[test]
fn captured_calls_give_the_launched_calls_bits() {
    let (_, graphs, tok) = smollm2();
    let launched = smollm2_cuda(CudaConfig { call_graphs: false, ..CudaConfig::default() });
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", long.as_str()];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    assert!(prompts[2].len() > 70, "the long prompt has {} tokens", prompts[2].len());
    // The long prompt's first call takes 70 rows (launched), then chunks of 1..3 with the
    // others' rows (captured at sizes 1..8).
    let plan = |step: usize, i: usize, _| match (step, i) {
        (0, 2) => 70,
        (0, _) => 0,
        _ => 1 + (step + i) % 3,
    };
    let before = graphs.backend.captures();
    let (a, calls) = run_counted(&graphs, &prompts, plan);
    let captured = graphs.backend.captures() - before;
    // One capture per (padded rows, padded head rows): at most 5 × 3, fewer than the calls
    // after the first (the 70-row one, launched).
    assert!((1..=15).contains(&captured) && captured < calls - 1, "{captured} captures for {} calls", calls - 1);
    let b = run(&launched, &prompts, plan);
    assert_eq!(launched.backend.captures(), 0, "call_graphs off captured calls");
    let mut compared = 0;
    for (ra, rb) in a.iter().flatten().zip(b.iter().flatten()) {
        if ra.is_nan() && rb.is_nan() {
            continue;
        }
        assert_eq!(ra.to_bits(), rb.to_bits(), "a captured call's logits differ from the launched call's");
        compared += 1;
    }
    assert!(compared >= 20 * graphs.logits_width(), "{compared} logits compared");
    // The same calls on a new store: its own graphs (a graph bakes in the store), as many,
    // and the same bits.
    let again = graphs.backend.captures();
    let c = run(&graphs, &prompts, plan);
    assert_eq!(graphs.backend.captures() - again, captured, "a new store's captures");
    assert!(a.iter().flatten().zip(c.iter().flatten()).all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// A call's rows that ask only for their argmax get the host's argmax of the logits the
/// same call gives (greedy serving reads one value a row); and `argmax_rows` by itself
/// picks the lowest index of tied maxima, over rows longer than a block's stride.
#[test]
fn device_argmax_of_a_call_is_the_hosts() {
    let (_, mg, tok) = smollm2();
    let texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let blocks = KvBlocks { full: 16, sliding: 0, head: 0 };
    let mut store = mg.backend.kv_store(&mg.cfg, blocks).unwrap();
    let mut paged = PagedKv::new(BLOCK, blocks.full, None);
    let mut seqs: Vec<SeqKv> = prompts.iter().map(|_| SeqKv::default()).collect();
    for (s, p) in seqs.iter_mut().zip(&prompts) {
        paged.reserve(s, p.len()).unwrap();
    }
    let tokens: Vec<u32> = prompts.concat();
    let spans: Vec<Span<'_>> = seqs.iter().zip(&prompts).map(|(s, p)| s.span(p.len())).collect();
    let v = mg.logits_width();
    let logits = mg.forward_spans(&tokens, &spans, &mut store).unwrap();
    // The same positions again (the same keys and values rewritten), two rows as tokens.
    let outs = mg.forward_spans_out(&tokens, &spans, &mut store, &[false, true, false]).unwrap();
    for (i, (out, want)) in outs.into_iter().zip(logits.chunks_exact(v)).enumerate() {
        match out {
            RowOut::Token(t) => assert_eq!(t, ferrolm::sample::argmax(want), "row {i}"),
            RowOut::Logits(l) => assert!(l == want, "row {i}: logits differ from the first call's"),
        }
    }
    let g = super::gpu();
    let (rows, cols) = (5, 70_001);
    let mut r = super::Rng::seeded();
    let mut x = r.v(rows * cols, 1.0);
    x[3 * cols + 69_000] = 9.0; // a tie: the lower index wins
    x[3 * cols + 1_000] = 9.0;
    x[4 * cols + cols - 1] = 9.0; // the last value
    let xg = g.act_from_f32(rows, cols, &x).unwrap();
    let mut out = g.act_poisoned(rows, 1, true).unwrap();
    g.argmax_rows(&xg, &mut out).unwrap();
    let got = g.read_rows(&out, 0).unwrap();
    for (i, row) in x.chunks_exact(cols).enumerate() {
        assert_eq!(got[i] as u32, ferrolm::sample::argmax(row), "row {i}");
    }
    assert_eq!(got[3] as usize, 1_000);
}

/// Each prompt read in one call, then `steps` generated rows a sequence (teacher-forced:
/// the prompt's tokens again, so every run feeds the same), through forward_generated_out
/// in the calls `active(step, sequence)` makes: each generated row's logits.
fn run_generated<B: Backend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    steps: usize,
    active: impl Fn(usize, usize) -> bool,
) -> Vec<Vec<Vec<f32>>> {
    let blocks = KvBlocks { full: 64, sliding: 0, head: 0 };
    let mut store = model.backend.kv_store_scheme(&model.cfg, blocks, model.kv_scheme()).unwrap();
    let mut paged = PagedKv::new(BLOCK, blocks.full, None);
    let mut seqs: Vec<SeqKv> = prompts.iter().map(|_| SeqKv::default()).collect();
    for (s, p) in seqs.iter_mut().zip(prompts) {
        paged.reserve(s, p.len()).unwrap();
        model.forward_spans(p, &[s.span(p.len())], &mut store).unwrap();
        s.len = p.len();
    }
    let mut out: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| vec![]).collect();
    for step in 0.. {
        let call: Vec<usize> = (0..prompts.len()).filter(|&i| out[i].len() < steps && active(step, i)).collect();
        if call.is_empty() {
            if out.iter().all(|o| o.len() == steps) {
                break;
            }
            continue;
        }
        let mut tokens = vec![];
        for &i in &call {
            let len = seqs[i].len;
            paged.reserve(&mut seqs[i], len + 1).unwrap();
            tokens.push(prompts[i][len % prompts[i].len()]);
        }
        let spans: Vec<Span<'_>> = call.iter().map(|&i| seqs[i].span(1)).collect();
        let rows = model.forward_generated_out(&tokens, &spans, &mut store, &vec![true; call.len()]).unwrap();
        for (&i, row) in call.iter().zip(rows) {
            match row {
                RowOut::Logits(l) => out[i].push(l),
                RowOut::Token(_) => panic!("logits were asked"),
            }
            seqs[i].len += 1;
        }
    }
    out
}

/// Generated rows (the decode step's kernels, batched: `Backend::begin_generated`) give a
/// sequence the same logits bits alone as in calls of 2 to 7 rows (padded or not, replayed
/// or launched), over cached spans of one to several attention splits (one cluster of them
/// or two); and agree with the CPU's.
#[test]
fn generated_rows_give_the_same_bits_alone_and_batched() {
    let (mc, mg, tok) = smollm2();
    let launched = smollm2_cuda(CudaConfig { call_graphs: false, ..CudaConfig::default() });
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(10);
    // ~500 tokens: its rows cross 512 positions, from one cluster of splits to two.
    let longer = "Pack my box with five dozen liquor jugs. ".repeat(50);
    let texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:",
        long.as_str(),
        "1, 2, 3, 4, 5, 6, 7, 8, 9,",
        "Once upon a time",
        "SELECT name FROM users WHERE",
        longer.as_str(),
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let steps = 24;
    let spans: Vec<(usize, usize)> = prompts.iter().map(|p| (p.len(), p.len() + steps)).collect();
    assert!(spans.iter().any(|&(a, b)| a < 512 && b > 512), "a row crosses 512 positions: {spans:?}");
    let alone = run_generated(&mg, &prompts, steps, |step, i| step / steps == i);
    let together = |step: usize, i: usize| !(step + i).is_multiple_of(4);
    for (model, what) in [(&mg, "replayed"), (&launched, "launched")] {
        let batched = run_generated(model, &prompts, steps, together);
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            for (s, (ra, rb)) in a.iter().zip(b).enumerate() {
                assert!(ra == rb, "{what}: sequence {i}'s generated row {s} differs from its row alone");
            }
        }
    }
    let cpu = run_generated(&mc, &prompts, steps, |step, i| step / steps == i);
    let (mut agree, mut n) = (0, 0);
    for (rg, rc) in alone.iter().flatten().zip(cpu.iter().flatten()) {
        agree += usize::from(ferrolm::sample::argmax(rg) == ferrolm::sample::argmax(rc));
        n += 1;
    }
    assert!(agree * 10 >= n * 9, "argmax agrees with the CPU's at {agree} of {n} generated rows");
}

/// Each prompt read in one call, then `steps` greedy tokens from one-row generated calls:
/// one call a token (`fed` empty), or fed runs of those lengths in turn
/// (`queue_generated_fed`, each run queued before the one before it is read, as the
/// serving engine does). The tokens, and every layer's K/V rows of the whole sequence.
fn greedy_generated(model: &Decoder<Cuda>, prompt: &[u32], steps: usize, fed: &[usize]) -> (Vec<u32>, Vec<u8>) {
    let b = &model.backend;
    let blocks = KvBlocks { full: 32, sliding: 0, head: 0 };
    let mut store = b.kv_store(&model.cfg, blocks).unwrap();
    let mut paged = PagedKv::new(BLOCK, blocks.full, None);
    let mut s = SeqKv::default();
    paged.reserve(&mut s, prompt.len() + steps).unwrap();
    let first = model.forward_spans_out(prompt, &[s.span(prompt.len())], &mut store, &[false]).unwrap();
    let RowOut::Token(first) = first[0] else { panic!("an argmax was asked") };
    let mut tokens = vec![first];
    let pos0 = prompt.len();
    if fed.is_empty() {
        for pos in pos0..pos0 + steps - 1 {
            let span = Span { rows: 1, pos0: pos, full: &s.full, sliding: &s.sliding };
            let out = model.forward_generated_out(&tokens[tokens.len() - 1..], &[span], &mut store, &[false]).unwrap();
            let RowOut::Token(t) = out[0] else { panic!("an argmax was asked") };
            tokens.push(t);
        }
    } else {
        let mut runs = vec![];
        let mut pos = pos0;
        for (k, &n) in fed.iter().cycle().enumerate() {
            let n = n.min(pos0 + steps - 1 - pos);
            if n == 0 {
                break;
            }
            let span = Span { rows: n, pos0: pos, full: &s.full, sliding: &s.sliding };
            let token = (k == 0).then_some(first);
            model.queue_generated_fed(token, span, &mut store, k % 2).unwrap();
            runs.push(k % 2);
            pos += n;
            if runs.len() == 2 {
                tokens.extend(b.take_read(runs.remove(0)).unwrap());
            }
        }
        for slot in runs {
            tokens.extend(b.take_read(slot).unwrap());
        }
    }
    let kv = ferrolm::kv::persist::export_payload(model, &store, (&s.full, &s.sliding), pos0 + steps - 1).unwrap();
    (tokens, kv)
}

/// Fed runs of generated calls (the serving engine's one stream) choose the tokens one
/// generated call a token chooses and write the same K/V bits, over runs of several
/// lengths and a cache past one attention split.
#[test]
fn fed_generated_calls_give_what_generated_calls_give() {
    let (_, mg, tok) = smollm2();
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(10);
    for text in ["The capital of France is", long.as_str()] {
        let prompt = tok.encode(text, true).unwrap();
        let steps = 40;
        let (want, want_kv) = greedy_generated(&mg, &prompt, steps, &[]);
        for fed in [&[8usize][..], &[1], &[5, 3, 16]] {
            let (got, got_kv) = greedy_generated(&mg, &prompt, steps, fed);
            assert_eq!(got, want, "fed runs of {fed:?} after {} prompt tokens", prompt.len());
            assert!(got_kv == want_kv, "fed runs of {fed:?}: the K/V rows differ");
        }
    }
}
