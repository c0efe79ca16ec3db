//! Prompts to token ids, as the CLI builds them: chat messages through the model's chat
//! template (special tokens parsed, nothing added: the template writes its own BOS), raw
//! text as plain text after the BOS the model adds, token ids as given. Templates and
//! tokenization of long texts take real time: call these from a blocking thread.

use crate::error::ApiError;
use crate::params::Prompt;
use ferrolm::tokenizer::{ChatMessage, Tokenizer};

/// How the server's model renders chat, found once at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Template {
    /// No chat template: /v1/chat/completions is refused.
    Missing,
    /// Renders a plain conversation: a failure is about the request's messages (400).
    Works,
    /// Fails even on a plain conversation: the model's template is broken (500).
    Broken,
}

impl Template {
    pub fn probe(tok: &Tokenizer) -> Template {
        if tok.chat_template().is_none() {
            return Template::Missing;
        }
        match tok.apply_chat_template(&[ChatMessage::new("user", "Hello")], true) {
            Ok(_) => Template::Works,
            Err(e) => {
                tracing::warn!("the model's chat template fails on a plain conversation: {e}");
                Template::Broken
            }
        }
    }
}

pub fn chat(tok: &Tokenizer, template: Template, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    if template == Template::Missing {
        return Err(ApiError::bad_request("this model has no chat template; use /v1/completions"));
    }
    let text = tok.apply_chat_template(messages, true).map_err(|e| {
        // The message names the model file first: the client needs the template's words only.
        let msg = e.to_string();
        let msg = msg.strip_prefix(&format!("{}: ", tok.source())).unwrap_or(&msg).to_string();
        match template {
            Template::Broken => ApiError::internal(format!("the model's {msg}")),
            _ => ApiError::invalid("messages", format!("the model's {msg}")),
        }
    })?;
    tok.encode_chat(&text).map_err(|e| ApiError::internal(e.to_string()))
}

pub fn completion(tok: &Tokenizer, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Tokens(ids) => Ok(ids.clone()),
        Prompt::Text(text) => {
            // User text is never parsed for special tokens; BOS as the model adds it.
            let mut ids = Vec::new();
            if tok.add_bos_default() {
                ids.extend(tok.bos_id());
            }
            ids.extend(tok.encode(text, false).map_err(|e| ApiError::internal(e.to_string()))?);
            Ok(ids)
        }
    }
}

/// The tokens to generate at most: the request's, which must fit the context after the
/// prompt, or else (None) `default` capped by the room left, or the whole room.
pub fn max_tokens(
    prompt: usize,
    asked: Option<usize>,
    default: Option<usize>,
    context: usize,
    param: &'static str,
) -> Result<usize, ApiError> {
    if prompt == 0 {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    if prompt >= context {
        return Err(ApiError::invalid(
            param,
            format!("this model's context is {context} tokens and the prompt has {prompt}: no room to generate"),
        ));
    }
    let room = context - prompt;
    match asked {
        Some(n) if n > room => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "this model's context is {context} tokens; the prompt has {prompt} and {n} more were requested \
                 (at most {room} fit)"
            ),
        )),
        Some(n) => Ok(n),
        None => Ok(default.map_or(room, |d| d.min(room))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_fits_the_context() {
        assert_eq!(max_tokens(10, Some(5), None, 20, "prompt"), Ok(5));
        assert_eq!(max_tokens(10, None, Some(16), 20, "prompt"), Ok(10));
        assert_eq!(max_tokens(10, None, None, 20, "prompt"), Ok(10));
        assert_eq!(max_tokens(10, Some(11), None, 20, "prompt").unwrap_err().param, Some("max_tokens"));
        assert_eq!(max_tokens(20, None, None, 20, "messages").unwrap_err().param, Some("messages"));
        assert_eq!(max_tokens(0, None, None, 20, "prompt").unwrap_err().status.as_u16(), 400);
    }
}
