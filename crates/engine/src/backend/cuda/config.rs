//! The CUDA backend's configuration: one struct, passed to `Cuda::with_config`. `Default`
//! is the measured best (docs/perf.md); `CudaConfig::from_env` (crate::env) applies the
//! `FERROLM_*` overrides docs/knobs.md lists. Each switch names a design that stays tested
//! against the other (gpu-check reruns the parity tests with it flipped).

use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Launch decode kernels with programmatic dependent launch (sm_90+): each one's weight
    /// loads overlap the previous kernel's tail. `FERROLM_PDL`.
    pub pdl: bool,
    /// The decode GEMV stages x as int16 with one scale per 32 values and multiplies with
    /// DP2A; off: bf16 x and f32 math. `FERROLM_GEMV_XQ`.
    pub gemv_int16_x: bool,
    /// A GEMV adding into the residual at one row per warp (the 1B's down) runs at two rows
    /// per warp over two K slices. `FERROLM_GEMV_KS`.
    pub gemv_k_slices: bool,
    /// The SwiGLU GEMV also writes down's input as the int16 image down's blocks copy in,
    /// instead of each block quantizing it. `FERROLM_GEMV_STAGED`.
    pub staged_x: bool,
    /// Gemma's post-norm adds (x += rmsnorm(y)·w after attention and MLP) are folded into
    /// the next GEMV's input staging instead of a launch each. `FERROLM_POST_NORM_FOLD`.
    pub post_norm_fold: bool,
    /// A decode MLP's gate and up run as one GEMV with the activation and product in its
    /// store; off: a GEMV writing both, then a GLU launch. `FERROLM_DECODE_GLU`.
    pub decode_fused_glu: bool,
    /// Prefill (several rows) runs the MLP's gate and up as one tensor-core GEMM with the
    /// activation and product in its epilogue (gemm.cu's qgemm_glu), instead of two GEMMs
    /// and a GLU launch (1.05-1.06x prefill on Gemma 3 270M and a 1B shape, docs/perf.md).
    /// `FERROLM_PREFILL_GLU`.
    pub prefill_fused_glu: bool,
    /// Prefill GEMMs of 128 tokens and more over 4096 rows and more take tiles of 128 tokens
    /// (each dequantized weight tile serves twice the tokens) instead of 64: +11% prefill on
    /// the 8B shape at 512 and 4096 tokens (docs/perf.md). `FERROLM_GEMM_WIDE`.
    pub gemm_wide_tiles: bool,
    /// Prefill GEMMs of 512 tokens and more on sm_90 devices (cols a multiple of 64)
    /// dequantize the weights into a bf16 copy and multiply on Hopper's warpgroup MMA
    /// (gemm_wgmma.cu) instead of the tiles dequantizing in the loop; the same bits. The 8B
    /// shape's prefill on an H100: pp512 1.29x the tiled kernels (with `wgmma_ahead` 1.33x;
    /// with the ring's two accumulator sets, the pass ahead yielding and the residual adds
    /// in the epilogue 1.61-1.64x llama.cpp), pp4096 1.79x in one 4096-token chunk (now
    /// 1.97x llama.cpp; docs/perf.md). `FERROLM_GEMM_WGMMA`.
    pub gemm_wgmma: bool,
    /// The fewest weights (rows · cols) of a matrix whose prefill GEMMs `gemm_wgmma` takes:
    /// 4096 · 1024, every matrix of the 8B shape (where it was measured end to end) and the
    /// 1B shape's but k and v (its kernel 1.07-1.46x at 512 tokens, docs/perf.md); smaller
    /// models keep the tiled kernels, not yet measured against it. `FERROLM_WGMMA_MIN_WEIGHTS`.
    pub wgmma_min_weights: usize,
    /// With `gemm_wgmma`, a prefill's next layer is dequantized on a side stream while the
    /// current layer runs (two layer-sized copies, 872 MB on an 8B model), so the GEMMs find
    /// their copies made instead of waiting for the pass: +3% at pp512, +7% at pp4096 in
    /// 512-token chunks on the 8B shape when first measured; the pass in short blocks on a
    /// low-priority stream since, +10% at pp512 over that first form (docs/perf.md).
    /// `FERROLM_WGMMA_AHEAD`.
    pub wgmma_ahead: bool,
    /// Prompt tokens per forward call of a session's prefill (`Backend::prefill_chunk`):
    /// 4096, so that each matrix is dequantized for the wgmma GEMM once per 4096 tokens,
    /// not eight times (8B pp4096 20,673 tok/s against 14,618 in chunks of 512). The serving
    /// engine's steps take at most min(this, 512) rows. `FERROLM_PREFILL_CHUNK`.
    pub prefill_chunk: usize,
    /// Prefill over a quantized KV store runs flash attention, its tiles dequantized into
    /// shared memory, instead of the split-K kernel on CUDA cores: turbo:k8v3's first token
    /// after 8192 cached positions on the 8B shape 4.24 s against 13.09 s, bf16's 4.48 s
    /// (docs/kv.md). `FERROLM_FLASH_KVQ`.
    pub flash_quant_prefill: bool,
    /// A decode step over a quantized KV store (head dims up to 128) encodes the new row and
    /// attends in one kernel (kv_quant.cu's attention_q_decode), then merges: the same bits
    /// as kv_encode, attention_q and attention_merge_q, which it runs when off. turbo:k8v3
    /// on the 8B shape +1.8% at depth 1024, +2.3% at 8192 (docs/kv.md). `FERROLM_KVQ_FUSED`.
    pub fused_quant_decode: bool,
    /// A greedy step's head GEMV finds the argmax as it stores the logits, instead of a
    /// separate argmax launch. `FERROLM_HEAD_ARGMAX`.
    pub head_argmax: bool,
    /// Decode attention over short caches merges its splits through a thread-block
    /// cluster's shared memory (sm_90+); off: through global memory. `FERROLM_ATTN_CLUSTER`.
    pub attention_clusters: bool,
    /// Most query heads of a GQA group one decode attention block serves (1 to 4) below
    /// `attention_mma_positions`; at head dims 64 and 128 more than one runs on the tensor
    /// cores (attention_decode_mma.cuh). `FERROLM_ATTN_QB`.
    pub attention_query_heads: usize,
    /// Decode attention over a cache of at least this many positions, at head dims 64 and
    /// 128, serves up to 4 query heads of a GQA group a block on the tensor cores, each K/V
    /// row read once (attention_decode_mma.cuh); shorter caches take
    /// `attention_query_heads`. 8B shape on an H100: 1.15x decode at depth 32768, 1.03x at
    /// 16384, 0.95x at 8192 (docs/kv.md). `usize::MAX`: never. `FERROLM_ATTN_MMA`.
    pub attention_mma_positions: usize,
    /// Smallest split, in cached positions, of the serving calls' attention (attention.cu's
    /// attention_split): a row's span is cut into at most `attention_max_splits` splits of
    /// this size doubled until they cover it; over a quantized cache (kv_quant.cu), chunks
    /// of ⌈span / most⌉, at least this size per query head a block serves (and at least
    /// `quant_split_sqrt`'s floor). `FERROLM_ATTN_CHUNK`.
    pub attention_min_chunk: usize,
    /// Over a quantized cache (kv_quant.cu's attention_q and attention_q_decode, decode and
    /// serving calls) a row's split is also at least ⌈this · √span⌉ positions: a split costs
    /// its partials and their merge, so short and middling spans take fewer, longer splits,
    /// while deep ones still take one wave's. 0: no such floor. 8B shape, H100, turbo:k8v3
    /// against 0: -0.6% at depth 1024, +3.4% at 2048, +5.5% at 4096, +3.3% at 8192, +2.1%
    /// at 16384 (k of 10, 14 and 20 slower; docs/kv.md). `FERROLM_KVQ_SPLIT_SQRT`.
    pub quant_split_sqrt: usize,
    /// Most splits a row's attention in a serving call takes (over a quantized cache, at
    /// most one wave's: kv_quant.rs `quant_max_splits`). `FERROLM_ATTN_SPLITS`.
    pub attention_max_splits: usize,
    /// Most tokens a batched decode GEMV block computes (gemv.cu's NT, a power of two):
    /// each weight tile, once in registers, meets that many tokens' x; fewer where they do
    /// not divide the tokens or their x would not fit the block's shared memory. Not yet
    /// measured. `FERROLM_GEMV_BATCH`.
    pub gemv_batch_tokens: usize,
    /// Greedy decode steps feed their token to the next step on the device, so the host
    /// never holds the GPU back. `FERROLM_CUDA_FEED`.
    pub feed_steps: bool,
    /// The serving engine's forward calls of up to 64 rows run padded to a power of two and
    /// replay a CUDA graph captured per padded size (and head rows, store, attention
    /// splits), instead of launching every kernel. `FERROLM_CALL_GRAPHS`.
    pub call_graphs: bool,
    /// Sampled steps take their top-k on the device and read back k pairs, not the logits.
    /// `FERROLM_CUDA_TOPK`.
    pub device_top_k: bool,
    /// Record a kernel timeline of decode steps into this file (tools/profile/
    /// trace_table.py reads it). `FERROLM_TRACE`.
    pub trace: Option<PathBuf>,
    /// With `trace`, record every kernel, not only decode steps'. `FERROLM_TRACE_ALL`.
    pub trace_all: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            pdl: true,
            gemv_int16_x: true,
            gemv_k_slices: true,
            staged_x: true,
            post_norm_fold: true,
            decode_fused_glu: true,
            prefill_fused_glu: true,
            gemm_wide_tiles: true,
            gemm_wgmma: true,
            wgmma_min_weights: 4096 * 1024,
            wgmma_ahead: true,
            prefill_chunk: 4096,
            flash_quant_prefill: true,
            fused_quant_decode: true,
            head_argmax: true,
            attention_clusters: true,
            attention_query_heads: 1,
            attention_mma_positions: 16384,
            attention_min_chunk: 64,
            attention_max_splits: 16,
            quant_split_sqrt: 12,
            gemv_batch_tokens: 8,
            feed_steps: true,
            call_graphs: true,
            device_top_k: true,
            trace: None,
            trace_all: false,
        }
    }
}
