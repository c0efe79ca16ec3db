//! A Hugging Face tokenizer directory: tokenizer.json (required) plus whatever of
//! tokenizer_config.json, chat_template.jinja / chat_template.json, special_tokens_map.json,
//! config.json and generation_config.json is there.

use super::Specials;
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

pub(super) struct DirParts {
    pub hf: tokenizers::Tokenizer,
    pub specials: Specials,
    pub chat_template: Option<String>,
    pub extra_stops: Vec<u32>,
}

/// A JSON file that may be absent; present but malformed is an error naming it.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let Some(text) = crate::files::read_text_if_present(path)? else { return Ok(None) };
    serde_json::from_str(&text).map(Some).map_err(|e| Error::format(path, format!("not valid JSON: {e}")))
}

/// A special token as tokenizer_config.json writes it: a string or {"content": ...}.
fn token_str(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A token id field of config.json / generation_config.json: an integer or a list of them.
fn ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n.as_u64().map(|i| i as u32).into_iter().collect(),
        Value::Array(a) => a.iter().filter_map(|x| x.as_u64()).map(|i| i as u32).collect(),
        _ => vec![],
    }
}

fn template_from_config(cfg: &Value, path: &Path) -> Result<Option<String>> {
    match &cfg["chat_template"] {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        // Several named templates: the one called "default" is the chat template.
        Value::Array(list) => {
            let named = |n: &str| list.iter().find(|t| t["name"] == n).and_then(|t| t["template"].as_str());
            let t = named("default").or_else(|| list.first().and_then(|t| t["template"].as_str()));
            t.map(|t| Some(t.to_string()))
                .ok_or_else(|| Error::format(path, "chat_template: a list without a \"template\" string"))
        }
        other => Err(Error::format(path, format!("chat_template: expected a string or a list, found {other}"))),
    }
}

/// `tokenizers`' parse of a tokenizer.json. Its deserializer panics on some malformed files
/// (a `decoder` entry that is not an object): that is caught and becomes an error, and its
/// panic message is kept off stderr (the hook is silenced for the parse).
fn parse_tokenizer(bytes: &[u8]) -> std::result::Result<tokenizers::Tokenizer, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes));
    std::panic::set_hook(hook);
    match r {
        Ok(parsed) => parsed.map_err(|e| e.to_string()),
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(format!("the tokenizers library failed on it ({})", msg.unwrap_or_default()))
        }
    }
}

pub(super) fn read(dir: &Path) -> Result<DirParts> {
    let tj = dir.join("tokenizer.json");
    let bytes = crate::files::read(&tj, crate::files::TEXT_LIMIT)?;
    let hf = parse_tokenizer(&bytes).map_err(|e| Error::format(&tj, format!("not a valid tokenizer.json: {e}")))?;

    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = read_json(&cfg_path)?.unwrap_or(Value::Null);
    let stm = read_json(&dir.join("special_tokens_map.json"))?.unwrap_or(Value::Null);
    let model_cfg = read_json(&dir.join("config.json"))?.unwrap_or(Value::Null);
    let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);

    // transformers ≥ 4.43 saves the template beside the config; that file wins.
    let jinja = dir.join("chat_template.jinja");
    let chat_template = match crate::files::read_text_if_present(&jinja)? {
        Some(t) => Some(t),
        None => match template_from_config(&cfg, &cfg_path)? {
            Some(t) => Some(t),
            None => {
                let p = dir.join("chat_template.json");
                match read_json(&p)? {
                    Some(v) => template_from_config(&v, &p)?,
                    None => None,
                }
            }
        },
    };

    // A special token by name: tokenizer_config, then special_tokens_map, then the model's
    // config files by id.
    let special = |name: &str| -> (Option<u32>, Option<String>) {
        let s = token_str(&cfg[name]).or_else(|| token_str(&stm[name]));
        if let Some(id) = s.as_deref().and_then(|s| hf.token_to_id(s)) {
            return (Some(id), s);
        }
        let key = format!("{name}_id");
        let id = ids(&model_cfg[&key]).into_iter().chain(ids(&gen_cfg[&key])).next();
        (id, id.and_then(|i| hf.id_to_token(i)))
    };
    // What tokenizer.json's post-processor adds around a text: the BOS/EOS it adds by default,
    // and their ids when no config file names them.
    let probe = |add: bool| {
        hf.encode("a", add)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::format(&tj, format!("encoding a probe string: {e}")))
    };
    let (with, without) = (probe(true)?, probe(false)?);
    let grew = with.len() > without.len();
    let lead = (grew && with.ends_with(&without)).then(|| with[0]);
    let trail = (grew && with.starts_with(&without)).then(|| with[with.len() - 1]);
    let named = |id: Option<u32>| id.and_then(|i| hf.id_to_token(i));

    let (bos_id, bos) = match special("bos_token") {
        (None, _) => (lead, named(lead)),
        found => found,
    };
    let (eos_id, eos) = match special("eos_token") {
        (None, _) => (trail, named(trail)),
        found => found,
    };
    let (_, unk) = special("unk_token");
    let (_, pad) = special("pad_token");
    let extra_stops = ids(&gen_cfg["eos_token_id"]).into_iter().chain(ids(&model_cfg["eos_token_id"])).collect();

    let flag = |key: &str, detected: bool| -> Result<bool> {
        match &cfg[key] {
            Value::Null => Ok(detected),
            Value::Bool(b) => Ok(*b),
            other => Err(Error::format(&cfg_path, format!("{key}: expected true or false, found {other}"))),
        }
    };
    let add_bos = flag("add_bos_token", lead.is_some() && lead == bos_id)?;
    let add_eos = flag("add_eos_token", trail.is_some() && trail == eos_id)?;
    Ok(DirParts {
        hf,
        specials: Specials { bos_id, eos_id, bos, eos, unk, pad, add_bos, add_eos },
        chat_template,
        extra_stops,
    })
}
