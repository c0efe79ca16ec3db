//! The serving engine on CUDA: 16 greedy requests running together give each the tokens it
//! gets running alone (calls of every padded size, captured and replayed, rows asking for
//! logits and rows asking only for their argmax), with generated rows in calls of their own
//! (the decode kernels, batched) and with every row in one call.

use super::smollm2_cuda;
use ferrolm::backend::cuda::CudaConfig;
use ferrolm::sample::SamplerConfig;
use ferrolm::serving::{Engine, EngineConfig, Event, Finish, Request};
use std::sync::mpsc;
use std::time::Duration;

fn request(prompt: Vec<u32>, logprobs: bool) -> Request {
    let sampler = SamplerConfig::default();
    Request { prompt, max_tokens: Some(24), sampler, logprobs: logprobs.then_some(2), stop_tokens: vec![] }
}

/// Submit the requests at once; each one's tokens.
fn run(e: &Engine, reqs: Vec<Request>) -> Vec<Vec<u32>> {
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
                    Event::Finished { reason: Finish::Length, .. } => return ids,
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
