//! The serving engine on the CPU with the real SmolLM2: requests that run together give
//! what each gives alone; the queue bound, cancellation, deadlines, stop tokens, limits and
//! shutdown behave as the front end relies on.

use ferrolm::backend::cpu::Cpu;
use ferrolm::model::Decoder;
use ferrolm::sample::{Sampler, SamplerConfig};
use ferrolm::serving::{Engine, EngineConfig, Event, FailureKind, Finish, Request, Sink, SubmitError};
use ferrolm::tokenizer::Tokenizer;
use std::sync::mpsc;
use std::time::Duration;

fn model_path() -> std::path::PathBuf {
    ferrolm::env::test_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn load() -> ferrolm::Result<Decoder<Cpu>> {
    let (mut src, _) = ferrolm::formats::load_with_tokenizer(&model_path(), false)?;
    Decoder::load(Cpu, &mut src)
}

fn tokenizer() -> Tokenizer {
    ferrolm::formats::load_with_tokenizer(&model_path(), false).unwrap().1
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::start(load, cfg).unwrap()
}

fn sink() -> (Sink, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    (Box::new(move |e| tx.send(e).is_ok()), rx)
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        max_tokens: Some(max_tokens),
        sampler: SamplerConfig::default(),
        logprobs: None,
        stop_tokens: vec![],
    }
}

/// The generated ids and how the request ended.
fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, Event) {
    let mut ids = vec![];
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event within 2 minutes") {
            Event::Token { id, .. } => ids.push(id),
            Event::Started { .. } => {}
            end => return (ids, end),
        }
    }
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at", "1, 2, 3, 4,", "Hi"]
        .iter()
        .map(|t| tok.encode(t, true).unwrap())
        .collect()
}

/// Greedy tokens of `prompt` from a session of its own.
fn alone(model: &Decoder<Cpu>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = ferrolm::generate::Session::new(model, prompt.len() + n).unwrap();
    let mut out = vec![];
    s.generate(prompt, n, &mut Sampler::new(SamplerConfig::default()), &[], |t| {
        out.push(t);
        Ok(true)
    })
    .unwrap();
    out
}

#[test]
fn requests_running_together_give_what_each_gives_alone() {
    let tok = tokenizer();
    let model = load().unwrap();
    let alone: Vec<Vec<u32>> = prompts(&tok).iter().map(|p| alone(&model, p, 12)).collect();
    // Four run at once, the other two wait for a place.
    let e = engine(EngineConfig { max_batch: 4, ..Default::default() });
    let rxs: Vec<_> = prompts(&tok)
        .into_iter()
        .map(|p| {
            let (s, rx) = sink();
            e.submit(greedy(p, 12), s).unwrap();
            rx
        })
        .collect();
    for (i, rx) in rxs.iter().enumerate() {
        let (ids, end) = collect(rx);
        assert_eq!(ids, alone[i], "request {i}");
        match end {
            Event::Finished { reason: Finish::Length, usage } => {
                assert_eq!((usage.prompt_tokens, usage.completion_tokens), (prompts(&tok)[i].len(), 12))
            }
            other => panic!("request {i} ended with {other:?}"),
        }
    }
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.requests_finished, st.kv_bytes_used), (0, 0, 6, 0), "{st:?}");
    // No budget given: a quarter of the available memory, at least the 4 GiB fallback's
    // order (the machine has GiBs), and the one the stats report.
    let auto = e.info().kv_memory;
    assert!(auto > 64 << 20 && st.kv_bytes_budget == auto, "auto budget {auto}, stats {st:?}");
    assert_eq!(st.generated_tokens, 72);
    // 6 requests of 12 tokens take at least 12 steps, each timed, its forward call inside it.
    assert!(st.steps >= 12, "{st:?}");
    assert!(st.forward_seconds > 0.0 && st.forward_seconds <= st.step_seconds, "{st:?}");
}

#[test]
fn stop_tokens_logprobs_and_limits() {
    let tok = tokenizer();
    let e = engine(EngineConfig { max_context: 64, kv_memory: Some(123 << 20), ..Default::default() });
    assert_eq!((e.info().kv_memory, e.stats().kv_bytes_budget), (123 << 20, 123 << 20));
    let p = prompts(&tok).remove(0);
    let (s, rx) = sink();
    e.submit(greedy(p.clone(), 8), s).unwrap();
    let (ids, _) = collect(&rx);
    // A stop token ends the generation before it, not handed out: the first that is new.
    let at = (1..ids.len()).find(|&i| !ids[..i].contains(&ids[i])).expect("a new token among 8");
    let (s, rx) = sink();
    e.submit(Request { stop_tokens: vec![ids[at]], ..greedy(p.clone(), 8) }, s).unwrap();
    let (got, end) = collect(&rx);
    assert_eq!(got, ids[..at]);
    assert!(matches!(end, Event::Finished { reason: Finish::Stop, usage } if usage.completion_tokens == at + 1));
    // Log-probabilities: the greedy token is the most probable, with n alternatives.
    let (s, rx) = sink();
    e.submit(Request { logprobs: Some(3), ..greedy(p.clone(), 4) }, s).unwrap();
    let mut seen = 0;
    while let Ok(ev) = rx.recv_timeout(Duration::from_secs(60)) {
        match ev {
            Event::Token { id, logprobs: Some(lp) } => {
                assert_eq!((lp.top.len(), lp.top[0].0, id), (3, id, ids[seen]));
                assert!(lp.logprob <= 0.0 && lp.logprob == lp.top[0].1 && lp.top[1].1 <= lp.top[0].1);
                seen += 1;
            }
            Event::Started { .. } => {}
            Event::Finished { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, 4);
    // Refused at submit, with the reason.
    let invalid = |r: Request| match e.submit(r, sink().0) {
        Err(SubmitError::Invalid(m)) => m,
        other => panic!("expected Invalid, got {other:?}"),
    };
    assert!(invalid(greedy(vec![], 4)).contains("empty"));
    assert!(invalid(greedy(vec![1; 60], 8)).contains("context is 64 tokens"));
    assert!(invalid(greedy(p.clone(), 0)).contains("at least 1"));
    assert!(invalid(greedy(vec![u32::MAX], 1)).contains("outside the vocabulary"));
    assert!(invalid(Request { logprobs: Some(21), ..greedy(p.clone(), 1) }).contains("top_logprobs"));
    let hot = SamplerConfig { temperature: -1.0, ..Default::default() };
    assert!(invalid(Request { sampler: hot, ..greedy(p.clone(), 1) }).contains("temperature"));
    // No max_tokens: until the context is full.
    let (s, rx) = sink();
    e.submit(Request { max_tokens: None, ..greedy(p.clone(), 1) }, s).unwrap();
    let (got, end) = collect(&rx);
    assert_eq!(got.len(), 64 - p.len(), "{end:?}");
}

#[test]
fn queue_bound_cancellation_deadline_and_shutdown() {
    let tok = tokenizer();
    let p = prompts(&tok).remove(1);
    let e = engine(EngineConfig { max_batch: 1, max_queue: 1, ..Default::default() });
    let (s1, rx1) = sink();
    let id1 = e.submit(greedy(p.clone(), 500), s1).unwrap();
    assert!(matches!(rx1.recv_timeout(Duration::from_secs(60)), Ok(Event::Started { .. })));
    // One running, one waiting: the next is refused with a retry hint.
    let (s2, rx2) = sink();
    e.submit(greedy(p.clone(), 4), s2).unwrap();
    match e.submit(greedy(p.clone(), 4), sink().0) {
        Err(SubmitError::Busy { retry_after }) => assert!(retry_after >= Duration::from_secs(1)),
        other => panic!("expected Busy, got {other:?}"),
    }
    // Cancelling the running one lets the waiting one run; the cancelled one hears nothing
    // after the tokens already sent.
    e.cancel(id1);
    let (ids, end) = collect(&rx2);
    assert!(ids.len() == 4 && matches!(end, Event::Finished { .. }));
    while let Ok(ev) = rx1.try_recv() {
        assert!(matches!(ev, Event::Token { .. }), "after cancel: {ev:?}");
    }
    // A sink that stops listening cancels its request.
    let (tx, rx3) = mpsc::channel();
    let mut n = 0;
    let quitting: Sink = Box::new(move |ev| {
        n += 1;
        tx.send(ev).is_ok() && n < 3
    });
    e.submit(greedy(p.clone(), 400), quitting).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rx3.try_iter().count(), 3);
    let st = e.stats();
    assert_eq!((st.running, st.requests_cancelled, st.requests_finished), (0, 2, 1), "{st:?}");
    // Every token handed out is counted, the cancelled requests' too.
    assert!(st.generated_tokens > 6, "4, 2 and at least 1: {st:?}");
    drop(e);
    // Deadline: a request running past the timeout fails.
    let e = engine(EngineConfig { request_timeout: Some(Duration::ZERO), ..Default::default() });
    let (s, rx) = sink();
    e.submit(greedy(p.clone(), 50), s).unwrap();
    assert!(
        matches!(collect(&rx).1, Event::Failed(f) if f.kind == FailureKind::Timeout && f.message.contains("timed out"))
    );
    drop(e);
    // Shutdown without grace: the running request fails, later ones are refused.
    let e = engine(EngineConfig::default());
    let (s, rx) = sink();
    e.submit(greedy(p.clone(), 2000), s).unwrap();
    assert!(matches!(rx.recv_timeout(Duration::from_secs(60)), Ok(Event::Started { .. })));
    e.shutdown(Duration::ZERO);
    assert!(matches!(collect(&rx).1, Event::Failed(f) if f.kind == FailureKind::Shutdown));
    assert_eq!(e.submit(greedy(p, 1), sink().0), Err(SubmitError::Closed));
}

/// A request sharing a long prefix with an earlier one reuses its cached blocks
/// (`cached_tokens`) and generates what it generates cold; when blocks run out requests are
/// preempted, recomputed, and still generate what each does alone.
#[test]
fn prefix_hits_and_preemption_give_the_cold_tokens() {
    prefix_hits_and_preemption(None);
}

/// The same with generated rows planned apart from prompt rows (what a backend whose
/// generated rows take the decode step's arithmetic needs; the CPU's rows all take one, so
/// the tokens cannot change): a preempted request recomputes its generated tokens one a
/// step, and a prompt holding an earlier request's reply finds only that request's prompt
/// blocks, where without it the reply's blocks are found too.
#[test]
fn generated_rows_apart_plan_and_key_their_blocks_apart() {
    prefix_hits_and_preemption(Some(true));
    let tok = tokenizer();
    let model = load().unwrap();
    let a = tok.encode("The river flows north through three towns, each with its own bridge and market.         The first town is the oldest and the second the largest; the third sits where the river meets         the sea, and ferries cross twice a day in summer.", true).unwrap();
    let block = ferrolm::kv::BLOCK;
    // Enough generated tokens to fill the block the prompt ends in, and one more.
    let n = 2 * block - a.len() % block;
    for apart in [false, true] {
        let e = engine(EngineConfig { generated_rows_apart: Some(apart), ..Default::default() });
        let (s, rx) = sink();
        e.submit(greedy(a.clone(), n), s).unwrap();
        let (reply, _) = collect(&rx);
        let mut b = a.clone();
        b.extend(&reply);
        b.extend(tok.encode(" And then?", false).unwrap());
        let (s, rx) = sink();
        e.submit(greedy(b.clone(), 4), s).unwrap();
        let cached = match rx.recv().unwrap() {
            Event::Started { cached_tokens, .. } => cached_tokens,
            other => panic!("{other:?}"),
        };
        let computed = (a.len() + n - 1) / block * block; // the reply's last token is not
        let want = if apart { a.len() / block * block } else { computed };
        assert_eq!(cached, want, "generated rows apart: {apart}");
        assert_eq!(collect(&rx).0, alone(&model, &b, 4), "generated rows apart: {apart}");
    }
}

fn prefix_hits_and_preemption(generated_rows_apart: Option<bool>) {
    let tok = tokenizer();
    let model = load().unwrap();
    let base = "You are a helpful assistant. Answer briefly and precisely, in plain words, without \
        lists or headings. Here is some background that both questions share: the river flows \
        north through three towns, each with its own bridge, market and school. The first town \
        is the oldest, the second the largest, and the third sits where the river meets the \
        sea. Ferries cross twice a day in summer and once a day in winter.";
    let a = tok.encode(&format!("{base} Which way does the river flow?"), true).unwrap();
    let b = tok.encode(&format!("{base} How many towns are there?"), true).unwrap();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(common >= 64, "{common} shared tokens");
    let want_b = alone(&model, &b, 8);
    let e = engine(EngineConfig { generated_rows_apart, ..Default::default() });
    let (s, rx) = sink();
    e.submit(greedy(a, 8), s).unwrap();
    collect(&rx);
    let (s, rx) = sink();
    e.submit(greedy(b.clone(), 8), s).unwrap();
    let hit = common / ferrolm::kv::BLOCK * ferrolm::kv::BLOCK;
    assert_eq!(rx.recv().unwrap(), Event::Started { prompt_tokens: b.len(), cached_tokens: hit });
    let (ids, end) = collect(&rx);
    assert_eq!(ids, want_b);
    assert!(matches!(end, Event::Finished { usage, .. } if usage.cached_tokens == hit), "{end:?}");
    assert_eq!(e.stats().cached_tokens, hit as u64);
    drop(e);
    // Ten blocks for four requests that grow to three blocks each.
    let block = ferrolm::kv::block_bytes(&model.cfg, &ferrolm::kv::scheme::KvScheme::Bf16).0;
    let e =
        engine(EngineConfig { max_batch: 4, kv_memory: Some(10 * block), generated_rows_apart, ..Default::default() });
    let ps: Vec<Vec<u32>> = prompts(&tok).into_iter().take(4).collect();
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| {
            let (s, rx) = sink();
            e.submit(greedy(p.clone(), 90 - p.len()), s).unwrap();
            rx
        })
        .collect();
    for (p, rx) in ps.iter().zip(&rxs) {
        let (ids, end) = collect(rx);
        assert!(matches!(end, Event::Finished { reason: Finish::Length, .. }), "{end:?}");
        assert_eq!(ids, alone(&model, p, 90 - p.len()));
    }
    let st = e.stats();
    assert!(st.preemptions > 0 && st.kv_bytes_used == 0 && st.running == 0, "{st:?}");
}

/// Gemma 3 270M (sliding layers of window 512): a prompt longer than the window, then one
/// sharing most of it. The second starts from the cached prefix, the sliding layers'
/// blocks of its window included, and generates what it generates alone.
#[test]
fn sliding_window_prefix_hits_give_the_cold_tokens() {
    let path = ferrolm::env::test_models_dir().join("gemma-3-270m-q4_k_m.gguf");
    let tok = ferrolm::formats::load_with_tokenizer(&path, false).unwrap().1;
    let load_gemma = move || -> ferrolm::Result<Decoder<Cpu>> {
        let (mut src, _) = ferrolm::formats::load_with_tokenizer(&path, false)?;
        Decoder::load(Cpu, &mut src)
    };
    let text = "The river flows north through three towns, each with its own bridge and market. ".repeat(50);
    let base = tok.encode(&text, true).unwrap()[..650].to_vec();
    let (mut a, mut b) = (base.clone(), base[..620].to_vec());
    a.extend(tok.encode(" Which way does it flow?", false).unwrap());
    b.extend(tok.encode(" How many towns?", false).unwrap());
    let model = load_gemma().unwrap();
    let want_b = alone(&model, &b, 6);
    drop(model);
    let e = Engine::start(load_gemma, EngineConfig { max_batch: 2, ..Default::default() }).unwrap();
    let (s, rx) = sink();
    e.submit(greedy(a, 6), s).unwrap();
    collect(&rx);
    let (s, rx) = sink();
    e.submit(greedy(b.clone(), 6), s).unwrap();
    let hit = 620 / ferrolm::kv::BLOCK * ferrolm::kv::BLOCK;
    assert_eq!(rx.recv().unwrap(), Event::Started { prompt_tokens: b.len(), cached_tokens: hit });
    assert_eq!(collect(&rx).0, want_b);
}

/// An engine whose model keeps its caches in `scheme`.
fn engine_with(scheme: &str, cfg: EngineConfig) -> Engine {
    engine_from(scheme, 0, cfg)
}

/// Submit every prompt of `ps` at once (greedy to 40 positions): each gives `want`'s.
fn each_gives_alone(e: &Engine, ps: &[Vec<u32>], want: &[Vec<u32>]) {
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| {
            let (s, rx) = sink();
            e.submit(greedy(p.clone(), 40 - p.len()), s).unwrap();
            rx
        })
        .collect();
    for (i, rx) in rxs.iter().enumerate() {
        let (ids, end) = collect(rx);
        assert!(matches!(end, Event::Finished { reason: Finish::Length, .. }), "{end:?}");
        assert_eq!(ids, want[i], "request {i}");
    }
}

/// A 100-token prompt, then one sharing its first 70 tokens (the second starts from the
/// first's two whole blocks): each gives what a session of its own gives.
fn a_prefix_hit_gives_the_cold_tokens(e: &Engine, model: &Decoder<Cpu>, ps: &[Vec<u32>]) {
    let long: Vec<u32> = ps.iter().flatten().copied().cycle().take(100).collect();
    let mut other = long[..70].to_vec();
    other.extend(&ps[1]);
    for p in [&long, &other] {
        let (s, rx) = sink();
        e.submit(greedy(p.clone(), 6), s).unwrap();
        let (ids, _) = collect(&rx);
        assert_eq!(ids, alone(model, p, 6));
    }
}

/// `engine_with`, the first `kv_start` positions of each request kept in bf16.
fn engine_from(scheme: &str, kv_start: usize, cfg: EngineConfig) -> Engine {
    let scheme = ferrolm::kv::scheme::KvScheme::parse(scheme).unwrap();
    Engine::start(
        move || {
            let mut m = load()?;
            m.set_kv_scheme(scheme)?;
            m.set_kv_start(kv_start)?;
            Ok(m)
        },
        cfg,
    )
    .unwrap()
}

/// `--kv-start 32` in the serving engine: each request's first block is bf16 (a pool of
/// its own), the rest turbo:k8v3; requests batched, waiting for head blocks, and one
/// starting from a cached prefix that spans both pools give what a session with the same
/// cache gives.
#[test]
fn leading_bf16_blocks_batch_and_share_prefixes() {
    let tok = tokenizer();
    let mut model = load().unwrap();
    model.set_kv_scheme(ferrolm::kv::scheme::KvScheme::parse("turbo").unwrap()).unwrap();
    model.set_kv_start(32).unwrap();
    let ps: Vec<Vec<u32>> = prompts(&tok).into_iter().take(4).collect();
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&model, p, 40 - p.len())).collect();
    // Two head blocks (at most half the budget) and seven of turbo rows.
    let (qb, hb) = (
        ferrolm::kv::block_bytes(&model.cfg, model.kv_scheme()).0,
        ferrolm::kv::block_bytes(&model.cfg, &ferrolm::kv::scheme::KvScheme::Bf16).0,
    );
    let e =
        engine_from("turbo", 32, EngineConfig { max_batch: 4, kv_memory: Some(4 * hb + 2 * qb), ..Default::default() });
    each_gives_alone(&e, &ps, &want);
    assert_eq!(e.stats().kv_blocks_total, 2 + 7, "{:?}", e.stats());
    drop(e);
    let e = engine_from("turbo", 32, EngineConfig { kv_memory: Some(64 * hb), ..Default::default() });
    a_prefix_hit_gives_the_cold_tokens(&e, &model, &ps);
    assert_eq!(e.stats().cached_tokens, 64, "{:?}", e.stats());
}

/// A quantized cache (turbo:k8v3) in the serving engine: requests batched together, one
/// starting from a cached prefix and ones preempted for lack of blocks each give what a
/// session of their own with the same cache scheme gives; the budget is counted in the
/// scheme's bytes (2.56 times bf16's tokens).
#[test]
fn quantized_caches_batch_share_prefixes_and_preempt() {
    let tok = tokenizer();
    let mut model = load().unwrap();
    model.set_kv_scheme(ferrolm::kv::scheme::KvScheme::parse("turbo").unwrap()).unwrap();
    let ps: Vec<Vec<u32>> = prompts(&tok).into_iter().take(4).collect();
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&model, p, 40 - p.len())).collect();
    // Five blocks for four requests that grow to two blocks each: some are preempted.
    let block = ferrolm::kv::block_bytes(&model.cfg, model.kv_scheme()).0;
    let e = engine_with("turbo", EngineConfig { max_batch: 4, kv_memory: Some(5 * block), ..Default::default() });
    each_gives_alone(&e, &ps, &want);
    let st = e.stats();
    // SmolLM2: 30 layers, 3 KV heads of 64: 100 bytes a head (bf16: 256).
    assert_eq!((st.kv_scheme.as_str(), st.kv_bytes_per_token), ("turbo:k8v3", 30 * 3 * 100), "{st:?}");
    assert!(st.kv_blocks_total == 5 && st.preemptions > 0, "{st:?}");
    drop(e);
    // The same budget holds 2.56 times the bf16 blocks.
    let budget = 64 * ferrolm::kv::block_bytes(&model.cfg, &ferrolm::kv::scheme::KvScheme::Bf16).0;
    let e = engine_with("turbo", EngineConfig { kv_memory: Some(budget), ..Default::default() });
    // A prompt, then one sharing its first blocks: the second starts from them.
    a_prefix_hit_gives_the_cold_tokens(&e, &model, &ps);
    let st = e.stats();
    assert_eq!(st.cached_tokens, 64, "{st:?}");
    assert_eq!(st.kv_blocks_total, 64 * 256 / 100, "{st:?}");
}

/// The prefix cache on disk: a prompt's blocks are saved when its prefill is done; an
/// engine started again on the same directory (a restart) starts a prompt sharing some of
/// them from disk, with the tokens it gives cold; another model's files are not used. For
/// a bf16 cache and a quantized one (turbo:k8v3), whose files an engine of the other scheme
/// on the same directory does not take.
#[test]
fn the_prefix_cache_on_disk_outlives_the_engine() {
    prefix_cache_on_disk_outlives_the_engine("bf16", "turbo");
    prefix_cache_on_disk_outlives_the_engine("turbo", "bf16");
}

fn prefix_cache_on_disk_outlives_the_engine(scheme: &str, other: &str) {
    use ferrolm::serving::PrefixCacheDir;
    let tok = tokenizer();
    let mut model = load().unwrap();
    model.set_kv_scheme(ferrolm::kv::scheme::KvScheme::parse(scheme).unwrap()).unwrap();
    let (src, t) = ferrolm::formats::load_with_tokenizer(&model_path(), false).unwrap();
    let fp = ferrolm::kv::file::model_fingerprint(&src, &t);
    let dir = tempfile::tempdir().unwrap();
    let cfg = |fp: &str| EngineConfig {
        prefix_cache_dir: Some(PrefixCacheDir { dir: dir.path().to_path_buf(), fingerprint: fp.into() }),
        ..Default::default()
    };
    let base = "Background for both questions: the river flows north through three towns, each with \
        its own bridge, market and school. The first town is the oldest, the second the largest, and \
        the third sits where the river meets the sea. Ferries cross twice a day in summer.";
    let a = tok.encode(&format!("{base} Which way does the river flow?"), true).unwrap();
    let question = "How many towns are there, which of them is the oldest, which is the largest, and \
        where does the river meet the sea? Answer in one short sentence, please.";
    let b = tok.encode(&format!("{base} {question}"), true).unwrap();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    // b shares a block with a, and has one of its own after them.
    assert!(common >= 32 && (b.len() - 1) / 32 > common / 32, "{common} shared tokens of {}", b.len());
    let want_b = alone(&model, &b, 8);
    let run = |e: &Engine, p: &[u32]| {
        let (s, rx) = sink();
        e.submit(greedy(p.to_vec(), 8), s).unwrap();
        let Event::Started { cached_tokens, .. } = rx.recv().unwrap() else { panic!("no start") };
        (cached_tokens, collect(&rx).0)
    };
    let engine = |c| engine_with(scheme, c);
    let e = engine(cfg(&fp));
    assert_eq!(run(&e, &a).0, 0);
    drop(e);
    let files = || std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files(), 1);
    let e = engine(cfg(&fp));
    assert_eq!(run(&e, &b), (common / ferrolm::kv::BLOCK * ferrolm::kv::BLOCK, want_b.clone()));
    drop(e);
    assert_eq!(files(), 2, "b's own blocks saved too");
    let e = engine(cfg("another model"));
    assert_eq!(run(&e, &b), (0, want_b));
    drop(e);
    // Its own file beside the first model's, which it did not write over.
    assert_eq!(files(), 3);
    let e = engine(cfg(&fp));
    assert_eq!(run(&e, &b).0, (b.len() - 1) / ferrolm::kv::BLOCK * ferrolm::kv::BLOCK, "b's own file");
    drop(e);
    // An engine of the other scheme computes b cold, and writes its own file.
    let e = engine_with(other, cfg(&fp));
    assert_eq!(run(&e, &b).0, 0, "{other} takes no {scheme} file");
    drop(e);
    assert_eq!(files(), 4);
}
