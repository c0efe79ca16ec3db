//! Errors are values: every failure names the file, tensor, field or request at fault.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file (or directory) is malformed. `file` names it, `msg` names the field/tensor.
    #[error("{file}: {msg}")]
    Format { file: String, msg: String },
    /// Well-formed input that ferrolm does not support (architecture, quant type, combination).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A bad argument or request.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().to_path_buf(), source }
    }
    pub fn format(file: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Format { file: file.as_ref().display().to_string(), msg: msg.into() }
    }
}
