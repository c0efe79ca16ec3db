//! KV cache schemes (`--kv SCHEME`): how keys and values are stored, and what a cached
//! position costs.
//! - `bf16` (the default): keys and values as bf16.
//! - `affine:8`, `affine:4`: MLX's affine_quantize rule (quant::affine::quantize_group) in
//!   groups of 64 along head_dim, bf16 scale and bias per group.
//! - `affine:FILE`: affine bits per layer from a JSON file: `{"bits": [8, 4, ...],
//!   "group_size": 64}` (one entry per layer, each 4 or 8; group_size optional, 64 only)
//!   or just the array.
//! - `turbo[:k<K>v<V>]` (default `turbo:k8v3`): TurboQuant (kv::turboquant), keys K bits
//!   in 8 (signed int8), 5, 4, 2; values V bits in 2, 3, 4, 5, 8; groups of 32.

use super::turboquant::{self, KeyFormat};
use crate::config::ModelConfig;
use crate::{Error, Result};
use std::path::Path;

/// Values per affine KV group along head_dim (MLX's default).
pub const AFFINE_GROUP: usize = 64;

/// Affine KV bit widths.
pub const AFFINE_BITS: [u32; 2] = [4, 8];

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvScheme {
    Bf16,
    /// Bits per layer (one entry: every layer).
    Affine(Vec<u32>),
    Turbo {
        key: KeyFormat,
        value_bits: u32,
    },
}

impl std::fmt::Display for KvScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvScheme::Bf16 => write!(f, "bf16"),
            KvScheme::Affine(b) if b.len() == 1 => write!(f, "affine:{}", b[0]),
            KvScheme::Affine(b) => {
                let list: Vec<String> = b.iter().map(u32::to_string).collect();
                write!(f, "affine:[{}]", list.join(","))
            }
            KvScheme::Turbo { key, value_bits } => write!(f, "turbo:k{}v{value_bits}", key.bits),
        }
    }
}

impl std::str::FromStr for KvScheme {
    type Err = Error;
    fn from_str(s: &str) -> Result<KvScheme> {
        KvScheme::parse(s)
    }
}

fn bad(s: &str, why: &str) -> Error {
    Error::Invalid(format!(
        "KV scheme {s:?}: {why} (expected bf16, affine:8, affine:4, affine:FILE.json or turbo[:k<8|5|4|2>v<2|3|4|5|8>])"
    ))
}

impl KvScheme {
    pub fn parse(s: &str) -> Result<KvScheme> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("bf16") {
            return Ok(KvScheme::Bf16);
        }
        if let Some(rest) = t.strip_prefix("affine:") {
            return match rest.parse::<u32>() {
                Ok(b) if AFFINE_BITS.contains(&b) => Ok(KvScheme::Affine(vec![b])),
                Ok(b) => Err(bad(s, &format!("affine KV takes 4 or 8 bits, not {b}"))),
                Err(_) => KvScheme::affine_file(Path::new(rest)),
            };
        }
        if t == "turbo" {
            return Ok(KvScheme::Turbo { key: KeyFormat::INT8, value_bits: 3 });
        }
        if let Some(rest) = t.strip_prefix("turbo:k") {
            let (k, v) = rest.split_once('v').ok_or_else(|| bad(s, "turbo takes k<bits>v<bits>"))?;
            let k: u32 = k.parse().map_err(|_| bad(s, "bad key bits"))?;
            let v: u32 = v.parse().map_err(|_| bad(s, "bad value bits"))?;
            let key = KeyFormat::for_bits(k).ok_or_else(|| bad(s, &format!("keys of {k} bits")))?;
            if !turboquant::VALUE_BITS.contains(&v) {
                return Err(bad(s, &format!("values of {v} bits")));
            }
            return Ok(KvScheme::Turbo { key, value_bits: v });
        }
        Err(bad(s, "unknown scheme"))
    }

    /// `affine:FILE`: per-layer bits from JSON.
    fn affine_file(path: &Path) -> Result<KvScheme> {
        let what = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Invalid(format!("KV scheme affine:{what}: reading the per-layer bits file: {e}")))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid(format!("KV scheme affine:{what}: not JSON: {e}")))?;
        if let Some(g) = v.get("group_size") {
            if g.as_u64() != Some(AFFINE_GROUP as u64) {
                return Err(Error::Invalid(format!(
                    "KV scheme affine:{what}: group_size {g}; affine KV groups are 64"
                )));
            }
        }
        let list = v.get("bits").unwrap_or(&v).as_array().ok_or_else(|| {
            Error::Invalid(format!(
                "KV scheme affine:{what}: expected {{\"bits\": [..]}} or an array of bits per layer"
            ))
        })?;
        let bits = list
            .iter()
            .enumerate()
            .map(|(i, b)| match b.as_u64() {
                Some(b @ (4 | 8)) => Ok(b as u32),
                _ => Err(Error::Invalid(format!("KV scheme affine:{what}: layer {i} has bits {b}; each is 4 or 8"))),
            })
            .collect::<Result<Vec<u32>>>()?;
        if bits.is_empty() {
            return Err(Error::Invalid(format!("KV scheme affine:{what}: no layers listed")));
        }
        Ok(KvScheme::Affine(bits))
    }

    /// Whether `cfg` can use this scheme; the error names what does not fit.
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        match self {
            KvScheme::Bf16 => Ok(()),
            KvScheme::Affine(bits) => {
                if !cfg.head_dim.is_multiple_of(AFFINE_GROUP) {
                    return Err(Error::Unsupported(format!(
                        "affine KV groups 64 values along head_dim; this model's head dim is {}",
                        cfg.head_dim
                    )));
                }
                if bits.len() != 1 && bits.len() != cfg.n_layers {
                    return Err(Error::Invalid(format!(
                        "KV scheme {self}: {} layers' bits for a model of {} layers",
                        bits.len(),
                        cfg.n_layers
                    )));
                }
                Ok(())
            }
            KvScheme::Turbo { .. } => turboquant::check_head_dim(cfg.head_dim),
        }
    }

    /// Bytes one cached position of one KV head takes in `layer` (keys and values).
    pub fn head_position_bytes(&self, head_dim: usize, layer: usize) -> usize {
        let value = match self {
            KvScheme::Bf16 | KvScheme::Affine(_) => self.head_key_bytes(head_dim, layer),
            // Packed codes, then an f16 RMS scale per group.
            KvScheme::Turbo { value_bits, .. } => {
                head_dim * *value_bits as usize / 8 + head_dim / turboquant::GROUP * 2
            }
        };
        self.head_key_bytes(head_dim, layer) + value
    }

    /// Bytes of the keys' part of `head_position_bytes` (kv::rows's layout: keys first).
    pub fn head_key_bytes(&self, head_dim: usize, layer: usize) -> usize {
        match self {
            KvScheme::Bf16 => 2 * head_dim,
            KvScheme::Affine(bits) => {
                let b = bits[if bits.len() == 1 { 0 } else { layer }] as usize;
                // Packed values, then a bf16 scale and bias per group.
                head_dim * b / 8 + head_dim / AFFINE_GROUP * 4
            }
            // Codes, then an f16 scale and zero point per group.
            KvScheme::Turbo { key, .. } => head_dim * key.bits as usize / 8 + head_dim / turboquant::GROUP * 4,
        }
    }

    /// Bytes one cached position takes in `layer` of `cfg` (every KV head's keys and values).
    pub fn layer_position_bytes(&self, cfg: &ModelConfig, layer: usize) -> usize {
        cfg.n_kv_heads * self.head_position_bytes(cfg.head_dim, layer)
    }

    /// Bytes one cached position takes over every layer and KV head of `cfg`.
    pub fn position_bytes(&self, cfg: &ModelConfig) -> usize {
        (0..cfg.n_layers).map(|l| self.layer_position_bytes(cfg, l)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_parse_and_print() {
        for (s, shown) in [
            ("bf16", "bf16"),
            ("affine:8", "affine:8"),
            ("affine:4", "affine:4"),
            ("turbo", "turbo:k8v3"),
            ("turbo:k4v2", "turbo:k4v2"),
            ("turbo:k2v8", "turbo:k2v8"),
        ] {
            assert_eq!(KvScheme::parse(s).unwrap().to_string(), shown);
        }
        for s in ["affine:6", "turbo:k3v3", "turbo:k8v6", "turbo:8", "int8", "affine:/no/such/file.json"] {
            let e = KvScheme::parse(s).unwrap_err().to_string();
            assert!(e.contains("KV scheme"), "{s}: {e}");
        }
    }

    #[test]
    fn turbo_k8v3_is_200_bytes_a_head_at_128() {
        let s = KvScheme::parse("turbo").unwrap();
        assert_eq!(s.head_position_bytes(128, 0), 200);
        assert_eq!(KvScheme::Bf16.head_position_bytes(128, 0), 512);
        assert_eq!(KvScheme::Affine(vec![8]).head_position_bytes(128, 0), 2 * (128 + 8));
        assert_eq!(KvScheme::Affine(vec![4]).head_position_bytes(128, 0), 2 * (64 + 8));
    }

    #[test]
    fn per_layer_bits_come_from_a_file_and_must_fit_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.json");
        std::fs::write(&path, r#"{"bits": [8, 4, 4, 8], "group_size": 64}"#).unwrap();
        let s = KvScheme::parse(&format!("affine:{}", path.display())).unwrap();
        assert_eq!(s, KvScheme::Affine(vec![8, 4, 4, 8]));
        let cfg = ModelConfig { n_layers: 4, n_kv_heads: 2, head_dim: 64, ..ModelConfig::default() };
        s.check(&cfg).unwrap();
        assert_eq!(s.position_bytes(&cfg), 2 * (2 * (64 + 4) + 2 * (32 + 4) + 2 * (32 + 4) + 2 * (64 + 4)));
        let e = s.check(&ModelConfig { n_layers: 5, ..cfg.clone() }).unwrap_err().to_string();
        assert!(e.contains("4 layers") && e.contains("5 layers"), "{e}");
        std::fs::write(&path, "[8, 6]").unwrap();
        let e = KvScheme::parse(&format!("affine:{}", path.display())).unwrap_err().to_string();
        assert!(e.contains("layer 1") && e.contains("6"), "{e}");
        let e = KvScheme::parse("turbo").unwrap().check(&ModelConfig { head_dim: 96, ..cfg }).unwrap_err();
        assert!(e.to_string().contains("96"), "{e}");
    }
}
