//! The one place ferrolm reads `FERROLM_*` environment variables; docs/knobs.md lists each
//! with its default and meaning. Everything else takes these values as arguments or from
//! the config structs filled here (`CudaConfig::from_env`).

use crate::backend::cuda::CudaConfig;
use std::path::PathBuf;
use std::sync::OnceLock;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// A switch that is on unless set to "0".
fn on_unless_zero(name: &str, default: bool) -> bool {
    var(name).map_or(default, |v| v != "0")
}

/// `FERROLM_HOME`: models and the kernel cache (default `~/.cache/ferrolm`).
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("FERROLM_HOME") {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    base.join(".cache").join("ferrolm")
}

/// `FERROLM_KERNEL_DIR`: a directory whose `.cu`/`.cuh` files replace the built-in kernel
/// text of the same name (kernel variants tried on a GPU machine without rebuilding the
/// binary: scripts/lab/gpu-ab.sh). Read once.
pub fn kernel_dir() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| std::env::var_os("FERROLM_KERNEL_DIR").map(PathBuf::from)).as_ref()
}

/// `FERROLM_SESSION_POOL`: finished sessions' parts (each a whole KV cache) a model keeps
/// for the next session: 2; 0 keeps none (every session captures its own steps).
pub fn session_pool() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| var("FERROLM_SESSION_POOL").and_then(|v| v.parse().ok()).unwrap_or(2))
}

/// `FERROLM_FEED_STEPS`: greedy decode steps one fed run captures and queues at once (1 to
/// `FEED_STEPS_MAX`): 8.
pub fn feed_steps() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| feed_steps_set().unwrap_or(8))
}

/// `FERROLM_FEED_STEPS` for `ferrolm serve`'s fed runs (`EngineConfig::fed_steps`): 1 unset,
/// where runs of 8 measured no faster and hand tokens out 8 at a time.
pub fn serve_feed_steps() -> usize {
    feed_steps_set().unwrap_or(crate::serving::EngineConfig::default().fed_steps)
}

fn feed_steps_set() -> Option<usize> {
    var("FERROLM_FEED_STEPS").and_then(|v| v.parse().ok()).filter(|n| (1..=crate::backend::FEED_STEPS_MAX).contains(n))
}

/// `FERROLM_ROWS_APART`: the serving engine plans generated rows apart from prompt rows
/// (1) or not (0); unset: as the backend says (`EngineConfig::generated_rows_apart`).
pub fn generated_rows_apart() -> Option<bool> {
    var("FERROLM_ROWS_APART").map(|v| v != "0")
}

impl CudaConfig {
    /// The defaults, with each knob docs/knobs.md lists overridden where its variable is
    /// set.
    pub fn from_env() -> CudaConfig {
        let d = CudaConfig::default();
        CudaConfig {
            pdl: on_unless_zero("FERROLM_PDL", d.pdl),
            gemv_int16_x: on_unless_zero("FERROLM_GEMV_XQ", d.gemv_int16_x),
            gemv_k_slices: on_unless_zero("FERROLM_GEMV_KS", d.gemv_k_slices),
            staged_x: on_unless_zero("FERROLM_GEMV_STAGED", d.staged_x),
            post_norm_fold: on_unless_zero("FERROLM_POST_NORM_FOLD", d.post_norm_fold),
            decode_fused_glu: on_unless_zero("FERROLM_DECODE_GLU", d.decode_fused_glu),
            prefill_fused_glu: on_unless_zero("FERROLM_PREFILL_GLU", d.prefill_fused_glu),
            head_argmax: on_unless_zero("FERROLM_HEAD_ARGMAX", d.head_argmax),
            gemm_wide_tiles: var("FERROLM_GEMM_WIDE").map_or(d.gemm_wide_tiles, |v| v == "1"),
            gemm_wgmma: on_unless_zero("FERROLM_GEMM_WGMMA", d.gemm_wgmma),
            wgmma_ahead: on_unless_zero("FERROLM_WGMMA_AHEAD", d.wgmma_ahead),
            wgmma_min_weights: var("FERROLM_WGMMA_MIN_WEIGHTS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(d.wgmma_min_weights),
            prefill_chunk: var("FERROLM_PREFILL_CHUNK")
                .and_then(|v| v.parse().ok())
                .map_or(d.prefill_chunk, |n: usize| n.clamp(16, 65536)),
            flash_quant_prefill: var("FERROLM_FLASH_KVQ").map_or(d.flash_quant_prefill, |v| v == "1"),
            fused_quant_decode: on_unless_zero("FERROLM_KVQ_FUSED", d.fused_quant_decode),
            attention_clusters: on_unless_zero("FERROLM_ATTN_CLUSTER", d.attention_clusters),
            attention_query_heads: var("FERROLM_ATTN_QB")
                .and_then(|v| v.parse().ok())
                .map_or(d.attention_query_heads, |n: usize| n.clamp(1, 4)),
            attention_mma_positions: var("FERROLM_ATTN_MMA").map_or(d.attention_mma_positions, |v| match v.as_str() {
                "off" => usize::MAX,
                n => n.parse().unwrap_or(d.attention_mma_positions),
            }),
            attention_min_chunk: var("FERROLM_ATTN_CHUNK")
                .and_then(|v| v.parse().ok())
                .map_or(d.attention_min_chunk, |n: usize| n.clamp(16, 4096)),
            attention_max_splits: var("FERROLM_ATTN_SPLITS")
                .and_then(|v| v.parse().ok())
                .map_or(d.attention_max_splits, |n: usize| n.clamp(1, 64)),
            quant_split_sqrt: var("FERROLM_KVQ_SPLIT_SQRT")
                .and_then(|v| v.parse().ok())
                .map_or(d.quant_split_sqrt, |n: usize| n.min(1024)),
            gemv_batch_tokens: var("FERROLM_GEMV_BATCH")
                .and_then(|v| v.parse().ok())
                .map_or(d.gemv_batch_tokens, |n: usize| n.clamp(1, 8).next_power_of_two()),
            feed_steps: on_unless_zero("FERROLM_CUDA_FEED", d.feed_steps),
            call_graphs: on_unless_zero("FERROLM_CALL_GRAPHS", d.call_graphs),
            device_top_k: on_unless_zero("FERROLM_CUDA_TOPK", d.device_top_k),
            trace: std::env::var_os("FERROLM_TRACE").filter(|p| !p.is_empty()).map(PathBuf::from),
            trace_all: var("FERROLM_TRACE_ALL").is_some_and(|v| v == "1"),
        }
    }
}

/// The TurboQuant codec test's `FERROLM_TQ_GOLDENS`: a vector file in the format of
/// ../shared/goldens/turboquant/codec-goldens.json (default: the copy of that file in
/// crates/engine/tests/goldens/turboquant/).
pub fn tq_goldens() -> Option<PathBuf> {
    std::env::var_os("FERROLM_TQ_GOLDENS").filter(|p| !p.is_empty()).map(PathBuf::from)
}

/// The test suite's `FERROLM_MODELS`: where its models are (scripts/fetch-test-models.sh
/// puts them there); default `$FERROLM_HOME/models`.
pub fn test_models_dir() -> PathBuf {
    std::env::var_os("FERROLM_MODELS").map(PathBuf::from).unwrap_or_else(|| home().join("models"))
}

/// The MLX convert check's `FERROLM_MLX_SCHEME` (a quantization applied before writing,
/// e.g. `mixed:4,8`) and `FERROLM_MLX_OUT` (where it writes; scripts/mlx-check.sh).
pub fn mlx_check() -> (Option<String>, Option<PathBuf>) {
    (var("FERROLM_MLX_SCHEME"), std::env::var_os("FERROLM_MLX_OUT").map(PathBuf::from))
}
