//! The serving engine on CUDA: 16 greedy requests running together give each the tokens it
//! gets running alone (calls of every padded size, captured and replayed, rows asking for
//! logits and rows asking only for their argmax), with generated rows in calls of their own
//! (the decode kernels, batched) and with every row in one call; a lone greedy request's
//! fed runs give it the tokens it gets token by token, Gemma 3's past its sliding window too.

use super::models::gemma3_path;
use super::smollm2_cuda;
use ferrolm::backend::cuda::{Cuda, CudaConfig};
use ferrolm::model::Decoder;
use ferrolm::sample::SamplerConfig;
use ferrolm::serving::{Engine, EngineConfig, Event, Finish, Request};
use std::sync::mpsc;
use std::time::Duration;

fn request(prompt: Vec<u32>, logprobs: bool) -> Request {
    let sampler = SamplerConfig::default();
    Request { prompt, max_tokens: Some(24), sampler, logprobs: logprobs.then_some(2), stop_tokens: vec![] }
}

/// Submit the requests at once; each one's tokens (each ends by its length).
fn run(e: &Engine, reqs: Vec<Request>) -> Vec<Vec<u32>> {
    run_ended(e, reqs)
        .into_iter()
        .map(|(ids, end)| {
            assert!(matches!(end, Finish::Length), "ended by {end:?}");
            ids
        })
        .collect()
}

/// Submit the requests at once; each one's tokens and how it finished.
fn run_ended(e: &Engine, reqs: Vec<Request>) -> Vec<(Vec<u32>, Finish)> {
    let rxs: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            e.submit(r, Box::new(move |ev| tx.send(ev).is_ok())).unwrap();
            rx
        })
        .collect();
    rxs.iter()
        .map(|rx| {
            let mut ids = vec![];
            loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("an event within 2 minutes") {
                    Event::Token { id, .. } => ids.push(id),
                    Event::Started { .. } => {}
                    Event::Finished { reason, .. } => return (ids, reason),
                    other => panic!("ended with {other:?}"),
                }
            }
        })
        .collect()
}

#[test]
fn sixteen_requests_together_give_what_each_gives_alone() {
    let tok = ferrolm::formats::load_with_tokenizer(&ferrolm::hub::default_model().unwrap(), false).unwrap().1;
    let texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"];
    let prompts: Vec<Vec<u32>> =
        (0..16).map(|i| tok.encode(&format!("{} {}", texts[i % 4], "and so on ".repeat(i)), true).unwrap()).collect();
    let reqs = |ps: &[Vec<u32>]| -> Vec<Request> {
        ps.iter().enumerate().map(|(i, p)| request(p.clone(), i % 5 == 0)).collect()
    };
    for apart in [true, false] {
        let e = Engine::start(
            || Ok(smollm2_cuda(CudaConfig::default())),
            EngineConfig {
                max_batch: 16,
                kv_memory: Some(256 << 20),
                generated_rows_apart: Some(apart),
                ..Default::default()
            },
        )
        .unwrap();
        let together = run(&e, reqs(&prompts));
        for (i, p) in prompts.iter().enumerate() {
            let alone = run(&e, vec![request(p.clone(), i % 5 == 0)]);
            assert_eq!(together[i], alone[0], "request {i} (rows apart: {apart}): together and alone differ");
        }
        assert!(together.iter().all(|t| t.len() == 24));
    }
}

/// An engine of one request at a time with rows apart and fed runs of `fed_steps` (0: one
/// planned step a token).
fn fed_engine(load: fn() -> Decoder<Cuda>, fed_steps: usize) -> Engine {
    let cfg = EngineConfig {
        max_batch: 1,
        kv_memory: Some(64 << 20),
        generated_rows_apart: Some(true),
        fed_steps,
        ..Default::default()
    };
    Engine::start(move || Ok(load()), cfg).unwrap()
}

fn smollm2_default() -> Decoder<Cuda> {
    smollm2_cuda(CudaConfig::default())
}

/// A lone greedy request decodes in fed runs (serving/fed.rs) to the tokens and the end it
/// gets with one planned step a token: runs that do not divide max_tokens, a stop token
/// inside a run (the run queued after it dropped unread), and the next request after it.
#[test]
fn fed_runs_give_a_lone_request_its_tokens() {
    let tok = ferrolm::formats::load_with_tokenizer(&ferrolm::hub::default_model().unwrap(), false).unwrap().1;
    let prompts = ["The capital of France is", "Once upon a time"].map(|t| tok.encode(t, true).unwrap());
    let req =
        |p: &[u32], stop: Vec<u32>| Request { max_tokens: Some(29), stop_tokens: stop, ..request(p.to_vec(), false) };
    let planned = fed_engine(smollm2_default, 0);
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| run(&planned, vec![req(p, vec![])]).remove(0)).collect();
    assert_eq!(planned.stats().fed_tokens, 0);
    // A stop token first chosen inside the second run of 8.
    let stop = want[0][11];
    let cut = want[0].iter().position(|&t| t == stop).unwrap();
    for fed_steps in [1, 8, 3] {
        let e = fed_engine(smollm2_default, fed_steps);
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&run(&e, vec![req(p, vec![])])[0], w, "fed runs of {fed_steps}");
        }
        let (ids, end) = run_ended(&e, vec![req(&prompts[0], vec![stop])]).remove(0);
        assert!(matches!(end, Finish::Stop) && ids == want[0][..cut], "fed runs of {fed_steps}: {end:?} after {ids:?}");
        assert_eq!(&run(&e, vec![req(&prompts[1], vec![])])[0], &want[1], "fed runs of {fed_steps}, after a stop");
        // Every token after each request's first came from fed runs.
        let fed = e.stats().fed_tokens as usize;
        assert_eq!(fed, 2 * 28 + cut + 28, "fed runs of {fed_steps}");
    }
}

fn gemma3() -> Decoder<Cuda> {
    let (mut b, _) = ferrolm::formats::load_with_tokenizer(&gemma3_path(), false).unwrap();
    Decoder::load(Cuda::with_config(0, CudaConfig::default()).unwrap(), &mut b).unwrap()
}

/// Gemma 3 270M's fed runs cross its sliding layers' 512-position window: a 500-token
/// prompt, then 90 tokens in fed runs, past position 543 (where the window leaves the
/// first 32-position block, then the second at 575: blocks released while a run is
/// queued), give the tokens one planned step a token gives.
#[test]
fn fed_runs_cross_gemmas_sliding_window() {
    let tok = ferrolm::formats::load_with_tokenizer(&gemma3_path(), false).unwrap().1;
    let text = "The river ran past the mill, and the miller counted the sacks. ".repeat(60);
    let mut prompt = tok.encode(&text, true).unwrap();
    prompt.truncate(500);
    assert_eq!(prompt.len(), 500, "a prompt of 500 tokens");
    let req = Request { max_tokens: Some(90), ..request(prompt, false) };
    let want = run(&fed_engine(gemma3, 0), vec![req.clone()]).remove(0);
    for fed_steps in [1, 8] {
        let e = fed_engine(gemma3, fed_steps);
        assert_eq!(run(&e, vec![req.clone()])[0], want, "Gemma 3, fed runs of {fed_steps}");
        assert_eq!(e.stats().fed_tokens, 89, "Gemma 3, fed runs of {fed_steps}");
    }
}
