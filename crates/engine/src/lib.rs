//! ferrolm engine: model formats, quantized weights, tokenizer, models and backends.

pub mod alloc_guard;
pub mod backend;
pub mod config;
pub mod env;
pub mod error;
pub mod eval;
pub mod files;
pub mod formats;
pub mod generate;
pub mod hub;
pub mod kv;
pub mod model;
pub mod progress;
pub mod quant;
pub mod sample;
pub mod serving;
pub mod tokenizer;

pub use error::{Error, Result};

// The lib's unit tests run with the allocator that bounds chat templates' memory.
#[cfg(test)]
#[global_allocator]
static ALLOC: alloc_guard::GuardedAlloc = alloc_guard::GuardedAlloc;
