//! Request bodies of /v1/chat/completions and /v1/completions, read field by field from the
//! JSON so that a wrong type names its field (a 400 with `param`). Unknown fields are
//! ignored as OpenAI ignores them; `null` is the same as absent. Fields that would change
//! what the answer means and that ferrolm does not do (tools, n > 1, echo, logit_bias) are
//! refused rather than silently dropped.

use crate::error::{quote, ApiError};
use ferrolm::sample::SamplerConfig;
use ferrolm::serving::MAX_TOP_LOGPROBS;
use ferrolm::tokenizer::ChatMessage;
use serde_json::{Map, Value};

/// Most stop sequences a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Longest stop sequence, in bytes: text that could begin one is held back while streaming.
pub const MAX_STOP_BYTES: usize = 1024;

/// What both routes take.
#[derive(Clone, Debug)]
pub struct Common {
    /// None: until the context is full (chat) or the route's default (completions).
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    /// A final chunk with the usage (stream_options.include_usage).
    pub include_usage: bool,
    /// Top log-probabilities per token, when the client asked for log-probabilities.
    pub logprobs: Option<usize>,
    /// Generate past the model's end-of-sequence tokens (vLLM's and llama.cpp's
    /// `ignore_eos`, for benchmarks).
    pub ignore_eos: bool,
}

#[derive(Clone, Debug)]
pub struct ChatParams {
    pub messages: Vec<ChatMessage>,
    pub common: Common,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionParams {
    pub prompt: Prompt,
    pub common: Common,
}

/// The body's JSON object: invalid UTF-8, malformed JSON and non-objects are 400s.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid UTF-8 ({e})")))?;
    match serde_json::from_str(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("the request body is not valid JSON: {e}"))),
    }
}

pub fn chat(body: &Map<String, Value>) -> Result<ChatParams, ApiError> {
    let f = Fields(body);
    let messages = messages(f.get("messages"))?;
    let logprobs = match (f.bool("logprobs")?.unwrap_or(false), f.uint("top_logprobs")?) {
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true")),
        (false, None) => None,
        (true, n) => Some(top_logprobs("top_logprobs", n.unwrap_or(0))?),
    };
    let max_tokens = match f.uint("max_completion_tokens")? {
        Some(n) => Some(max_tokens("max_completion_tokens", n)?),
        None => f.uint("max_tokens")?.map(|n| max_tokens("max_tokens", n)).transpose()?,
    };
    refuse_unsupported(&f, &["tools", "functions", "tool_choice", "function_call"])?;
    if let Some(fmt) = f.object("response_format")? {
        if fmt.get("type").is_some_and(|t| t != "text") {
            return Err(ApiError::invalid("response_format", "only response_format type \"text\" is supported"));
        }
    }
    Ok(ChatParams { messages, common: common(&f, max_tokens, logprobs)? })
}

pub fn completion(body: &Map<String, Value>) -> Result<CompletionParams, ApiError> {
    let f = Fields(body);
    let prompt = prompt(f.get("prompt"))?;
    let logprobs = f.uint("logprobs")?.map(|n| top_logprobs("logprobs", n)).transpose()?;
    let max_tokens = f.uint("max_tokens")?.map(|n| max_tokens("max_tokens", n)).transpose()?;
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if f.uint("best_of")?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("best_of", "only best_of = 1 is supported"));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    Ok(CompletionParams { prompt, common: common(&f, max_tokens, logprobs)? })
}

fn common(f: &Fields, max_tokens: Option<usize>, logprobs: Option<usize>) -> Result<Common, ApiError> {
    if f.uint("n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n", "only n = 1 is supported"));
    }
    if f.object("logit_bias")?.is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::invalid("logit_bias", "logit_bias is not supported"));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(_) if !stream => {
            return Err(ApiError::invalid("stream_options", "stream_options is only allowed when stream is true"))
        }
        Some(o) => Fields(o).bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    Ok(Common {
        max_tokens,
        sampler: sampler(f)?,
        stop: stops(f.get("stop"))?,
        stream,
        include_usage,
        logprobs,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
    })
}

/// The sampler from OpenAI's fields (and the extensions vLLM and llama.cpp also take:
/// top_k, min_p, repetition_penalty), checked by `SamplerConfig::validate`.
fn sampler(f: &Fields) -> Result<SamplerConfig, ApiError> {
    let top_k = match f.int("top_k")? {
        None | Some(-1) => 0,
        Some(k) if k >= 0 => k as usize,
        Some(_) => return Err(ApiError::invalid("top_k", "top_k must be ≥ 0 (or -1 for off)")),
    };
    let seed = match f.int("seed")? {
        Some(s) => s as u64,
        None => rand::random(),
    };
    let d = SamplerConfig::default();
    let cfg = SamplerConfig {
        // OpenAI's default temperature is 1.
        temperature: f.number("temperature")?.unwrap_or(1.0),
        top_k,
        top_p: f.number("top_p")?.unwrap_or(1.0),
        min_p: f.number("min_p")?.unwrap_or(0.0),
        repetition_penalty: f.number("repetition_penalty")?.unwrap_or(1.0),
        // The penalty looks at the whole conversation, not a window of it.
        penalty_window: 0,
        presence_penalty: f.number("presence_penalty")?.unwrap_or(0.0),
        frequency_penalty: f.number("frequency_penalty")?.unwrap_or(0.0),
        seed,
    };
    if let Err(e) = cfg.validate() {
        // Name the field: the one that fails on its own.
        let alone: [(&'static str, SamplerConfig); 5] = [
            ("temperature", SamplerConfig { temperature: cfg.temperature, ..d.clone() }),
            ("top_p", SamplerConfig { top_p: cfg.top_p, ..d.clone() }),
            ("min_p", SamplerConfig { min_p: cfg.min_p, ..d.clone() }),
            ("repetition_penalty", SamplerConfig { repetition_penalty: cfg.repetition_penalty, ..d.clone() }),
            ("presence_penalty", SamplerConfig { presence_penalty: cfg.presence_penalty, ..d.clone() }),
        ];
        let param = alone.iter().find(|(_, c)| c.validate().is_err()).map_or("frequency_penalty", |(p, _)| p);
        return Err(ApiError::invalid(param, e.to_string()));
    }
    Ok(cfg)
}

fn max_tokens(param: &'static str, n: u64) -> Result<usize, ApiError> {
    match usize::try_from(n) {
        Ok(0) => Err(ApiError::invalid(param, format!("{param} must be at least 1"))),
        Ok(n) => Ok(n),
        Err(_) => Err(ApiError::invalid(param, format!("{param} {n} is too large"))),
    }
}

fn top_logprobs(param: &'static str, n: u64) -> Result<usize, ApiError> {
    if n > MAX_TOP_LOGPROBS as u64 {
        return Err(ApiError::invalid(param, format!("{param} must be at most {MAX_TOP_LOGPROBS}")));
    }
    Ok(n as usize)
}

fn refuse_unsupported(f: &Fields, names: &[&'static str]) -> Result<(), ApiError> {
    for &name in names {
        let given = match f.get(name) {
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::String(s)) => s != "none",
            Some(_) => true,
            None => false,
        };
        if given {
            return Err(ApiError::invalid(name, format!("{name} is not supported")));
        }
    }
    Ok(())
}

/// `stop`: a string or a list of up to `MAX_STOPS` strings; empty strings match nothing.
fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid("stop", "stop must be a string or a list of strings");
    let list: Vec<String> = match v {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            a.iter().map(|s| s.as_str().map(String::from).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad()),
    };
    if list.len() > MAX_STOPS {
        return Err(ApiError::invalid("stop", format!("stop may have at most {MAX_STOPS} sequences")));
    }
    if list.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid("stop", format!("a stop sequence may have at most {MAX_STOP_BYTES} bytes")));
    }
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

fn messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let bad = |m: String| ApiError::invalid("messages", m);
    let list = match v {
        None => return Err(bad("messages is required".into())),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("messages must be a list of messages".into())),
    };
    if list.is_empty() {
        return Err(bad("messages must not be empty".into()));
    }
    list.iter().enumerate().map(|(i, m)| message(i, m)).collect()
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let bad = |m: String| ApiError::invalid("messages", format!("messages[{i}]: {m}"));
    let Value::Object(m) = m else { return Err(bad("a message must be an object".into())) };
    let role = match m.get("role") {
        Some(Value::String(r)) => match r.as_str() {
            "system" | "user" | "assistant" => r.clone(),
            // OpenAI's newer name for the system message.
            "developer" => "system".into(),
            other => {
                return Err(bad(format!(
                    "unknown role {}: expected system, developer, user or assistant",
                    quote(other)
                )))
            }
        },
        Some(_) => return Err(bad("role must be a string".into())),
        None => return Err(bad("role is required".into())),
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(parts).map_err(bad)?,
        // An assistant turn that only called tools has no content.
        Some(Value::Null) | None if role == "assistant" => String::new(),
        None | Some(Value::Null) => return Err(bad("content is required".into())),
        Some(_) => return Err(bad("content must be a string or a list of content parts".into())),
    };
    Ok(ChatMessage { role, content })
}

/// Content given as parts: only text parts, joined by newlines (as vLLM joins them).
fn text_parts(parts: &[Value]) -> Result<String, String> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let kind = p.get("type").and_then(Value::as_str);
        match (kind, p.get("text")) {
            (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
            (Some("text"), _) => return Err(format!("content[{j}]: a text part needs a string \"text\"")),
            (Some(other), _) => {
                return Err(format!("content[{j}]: part type {} is not supported (text only)", quote(other)))
            }
            (None, _) => return Err(format!("content[{j}]: a content part needs a string \"type\"")),
        }
    }
    Ok(texts.join("\n"))
}

/// `prompt`: a string, a list of token ids, or a list holding one of those.
fn prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let bad = |m: &str| ApiError::invalid("prompt", m);
    match v {
        None => Err(bad("prompt is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) => match a.as_slice() {
            [one @ (Value::String(_) | Value::Array(_))] => prompt(Some(one)),
            [_, _, ..] if a.iter().all(|x| x.is_string() || x.is_array()) => {
                Err(bad("only one prompt per request is supported"))
            }
            ids => ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .map(Prompt::Tokens)
                .ok_or_else(|| bad("prompt must be a string or a list of token ids (integers ≥ 0)")),
        },
        Some(_) => Err(bad("prompt must be a string or a list of token ids")),
    }
}

/// A JSON object's fields, each read with its type checked.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn number(&self, k: &'static str) -> Result<Option<f32>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => {
                v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| ApiError::invalid(k, format!("{k} must be a number")))
            }
        }
    }

    /// An integer ≥ 0; a negative one is its own error (e.g. max_tokens: -1).
    fn uint(&self, k: &'static str) -> Result<Option<u64>, ApiError> {
        match self.int(k)? {
            Some(n) if n < 0 => Err(ApiError::invalid(k, format!("{k} must be ≥ 0 (got {n})"))),
            n => Ok(n.map(|n| n as u64)),
        }
    }

    fn int(&self, k: &'static str) -> Result<Option<i64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match (v.as_i64(), v.as_u64()) {
                (Some(n), _) => Ok(Some(n)),
                (None, Some(_)) => Err(ApiError::invalid(k, format!("{k} is too large"))),
                _ => Err(ApiError::invalid(k, format!("{k} must be an integer"))),
            },
        }
    }

    fn bool(&self, k: &'static str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| ApiError::invalid(k, format!("{k} must be true or false"))),
        }
    }

    fn str(&self, k: &'static str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| ApiError::invalid(k, format!("{k} must be a string"))),
        }
    }

    fn object(&self, k: &'static str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_object().map(Some).ok_or_else(|| ApiError::invalid(k, format!("{k} must be an object"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn chat_err(v: Value) -> ApiError {
        chat(&obj(v)).unwrap_err()
    }

    #[test]
    fn chat_fields_are_read() {
        let p = chat(&obj(json!({
            "model": "x", "messages": [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1,
            "seed": 3, "stop": "x", "logprobs": true, "top_logprobs": 2, "unknown_field": {"a": 1}, "user": null
        })))
        .unwrap();
        assert_eq!(p.messages, vec![ChatMessage::new("system", "be brief"), ChatMessage::new("user", "a\nb")]);
        let c = p.common;
        assert_eq!((c.max_tokens, c.logprobs, c.stop), (Some(7), Some(2), vec!["x".to_string()]));
        assert_eq!((c.sampler.temperature, c.sampler.top_p, c.sampler.top_k, c.sampler.seed), (0.0, 0.5, 0, 3));
        assert_eq!(c.sampler.penalty_window, 0);
    }

    #[test]
    fn wrong_fields_name_their_param() {
        let cases = [
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages"),
            (json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "messages"),
            (json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "temperature"),
            (json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}), "temperature"),
            (json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}), "top_p"),
            (json!({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}), "top_p"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stop": 7}), "stop"),
            (json!({"messages": [{"role": "user", "content": "x"}], "n": 2}), "n"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stream_options": {}}), "stream_options"),
            (json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "top_logprobs"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}), "frequency_penalty"),
            (json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}), "tools"),
        ];
        for (body, param) in cases {
            let e = chat_err(body.clone());
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{body}: {}", e.message);
        }
    }

    #[test]
    fn prompts_of_every_shape() {
        let p = |v: Value| completion(&obj(json!({ "prompt": v }))).map(|c| c.prompt);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!([[3]])).unwrap(), Prompt::Tokens(vec![3]));
        assert_eq!(p(json!(["one"])).unwrap(), Prompt::Text("one".into()));
        for bad in [json!(["a", "b"]), json!([1, -2]), json!([1, "a"]), json!(5), json!(null)] {
            assert_eq!(p(bad.clone()).unwrap_err().param, Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn bodies_that_are_not_json_objects() {
        assert!(parse_object(b"\xff\xfe").unwrap_err().message.contains("UTF-8"));
        assert!(parse_object(b"{\"a\":").unwrap_err().message.contains("not valid JSON"));
        assert!(parse_object(b"[1]").unwrap_err().message.contains("JSON object"));
        assert!(parse_object(b"{}").is_ok());
    }
}
