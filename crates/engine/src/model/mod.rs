//! Model architectures, written once against the backend ops.

pub mod decoder;
mod kv_cache;
pub mod shard;

pub use decoder::{Decoder, Logits, RowOut};
