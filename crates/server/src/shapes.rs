//! The JSON of OpenAI's responses and stream chunks, field for field: chat completions
//! (`chat.completion`, `chat.completion.chunk`) and legacy completions (`text_completion`).

use crate::holdback::TokenInfo;
use ferrolm::serving::Usage;
use serde_json::{json, Value};

/// Which API a request came through: the shapes differ, the generation does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

/// What every response and chunk of one request repeats.
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Api {
    pub fn id_prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl-",
            Api::Completion => "cmpl-",
        }
    }

    /// The name of the route, for log lines.
    pub fn route(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completion => "/v1/completions",
        }
    }

    /// The whole answer of a request that did not stream.
    pub fn response(self, m: &Meta, text: &str, logprobs: Option<&[TokenInfo]>, finish: &str, usage: &Usage) -> Value {
        let choice = match self {
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs.map(chat_logprobs),
                "finish_reason": finish,
            }),
            Api::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": logprobs.map(completion_logprobs),
                "finish_reason": finish,
            }),
        };
        let object = match self {
            Api::Chat => "chat.completion",
            Api::Completion => "text_completion",
        };
        json!({
            "id": m.id, "object": object, "created": m.created, "model": m.model,
            "system_fingerprint": null, "choices": [choice], "usage": usage_json(usage),
        })
    }

    /// The chunk that opens a chat stream (the assistant's role), before any text.
    pub fn opening_chunk(self, m: &Meta, with_usage: bool) -> Option<Value> {
        (self == Api::Chat).then(|| {
            self.chunk(m, vec![chat_choice(json!({"role": "assistant", "content": ""}), None, None)], with_usage)
        })
    }

    /// A chunk of streamed text with its tokens' log-probabilities.
    pub fn text_chunk(self, m: &Meta, text: &str, logprobs: Option<&[TokenInfo]>, with_usage: bool) -> Value {
        let choice = match self {
            Api::Chat => chat_choice(json!({"content": text}), logprobs.map(chat_logprobs), None),
            Api::Completion => completion_choice(text, logprobs.map(completion_logprobs), None),
        };
        self.chunk(m, vec![choice], with_usage)
    }

    /// The chunk that says why the stream ended.
    pub fn finish_chunk(self, m: &Meta, finish: &str, with_usage: bool) -> Value {
        let choice = match self {
            Api::Chat => chat_choice(json!({}), None, Some(finish)),
            Api::Completion => completion_choice("", None, Some(finish)),
        };
        self.chunk(m, vec![choice], with_usage)
    }

    /// stream_options.include_usage: the last chunk, with no choices and the usage.
    pub fn usage_chunk(self, m: &Meta, usage: &Usage) -> Value {
        let mut c = self.chunk(m, vec![], false);
        c["usage"] = usage_json(usage);
        c
    }

    fn chunk(self, m: &Meta, choices: Vec<Value>, with_usage: bool) -> Value {
        let object = match self {
            Api::Chat => "chat.completion.chunk",
            Api::Completion => "text_completion",
        };
        let mut c = json!({
            "id": m.id, "object": object, "created": m.created, "model": m.model,
            "system_fingerprint": null, "choices": choices,
        });
        if with_usage {
            // OpenAI sends `usage: null` on every chunk but the last when usage was asked.
            c["usage"] = Value::Null;
        }
        c
    }
}

fn chat_choice(delta: Value, logprobs: Option<Value>, finish: Option<&str>) -> Value {
    json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
}

fn completion_choice(text: &str, logprobs: Option<Value>, finish: Option<&str>) -> Value {
    json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// A log-probability as JSON: a finite number (an impossible token's -inf becomes the
/// most negative f32, as JSON has no infinity).
fn logprob(p: f32) -> Value {
    json!(if p.is_finite() { p } else { f32::MIN })
}

/// Chat's shape: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
fn chat_logprobs(tokens: &[TokenInfo]) -> Value {
    let entry = |text: &str, p: f32| json!({"token": text, "logprob": logprob(p), "bytes": text.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.text, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, p)| entry(s, *p)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions' shape: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (one
/// object of token → logprob per position) and `text_offset`.
fn completion_logprobs(tokens: &[TokenInfo]) -> Value {
    json!({
        "tokens": tokens.iter().map(|t| t.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| logprob(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": tokens
            .iter()
            .map(|t| t.top.iter().map(|(s, p)| (s.clone(), logprob(*p))).collect::<serde_json::Map<_, _>>())
            .collect::<Vec<_>>(),
        "text_offset": tokens.iter().map(|t| t.offset).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprob_shapes() {
        let t = vec![TokenInfo {
            text: "é".into(),
            logprob: -0.5,
            top: vec![("é".into(), -0.5), ("a".into(), f32::NEG_INFINITY)],
            offset: 3,
        }];
        let c = chat_logprobs(&t);
        assert_eq!(c["content"][0]["bytes"], json!([0xc3, 0xa9]));
        assert_eq!(c["content"][0]["top_logprobs"][1]["logprob"], json!(f32::MIN));
        let p = completion_logprobs(&t);
        assert_eq!(p["tokens"], json!(["é"]));
        assert_eq!(p["top_logprobs"][0]["é"], json!(-0.5));
        assert_eq!(p["text_offset"], json!([3]));
    }
}
