//! Model architectures, written once against the backend ops.

pub mod decoder;
mod kv_cache;

pub use decoder::{Decoder, Logits, RowOut};
