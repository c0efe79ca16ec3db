//! Model architectures, written once against the backend ops.

pub mod llama;

pub use llama::{Llama, Logits};
