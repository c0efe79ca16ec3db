//! Model architectures, written once against the backend ops.

pub mod decoder;

pub use decoder::{Decoder, Logits, RowOut};
