//! Tokenizer.
