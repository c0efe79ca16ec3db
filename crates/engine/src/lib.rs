//! ferrolm engine: model formats, quantized weights, tokenizer, models and backends.

pub mod backend;
pub mod config;
pub mod env;
pub mod error;
pub mod files;
pub mod formats;
pub mod generate;
pub mod hub;
pub mod kv;
pub mod model;
pub mod progress;
pub mod quant;
pub mod sample;
pub mod tokenizer;

pub use error::{Error, Result};
