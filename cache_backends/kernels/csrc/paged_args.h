// The arguments of one paged-attention call, as plain pointers and sizes (no torch types), shared by the op's
// registration (ops.cpp) and the kernels compiled once per instruction set (attention_avx2.cpp,
// attention_portable.cpp).
#pragma once
#include <cstdint>

namespace kvserve {

// Element types of the pool's exact tokens and of the quantized tiers' scales and zero points.
enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

struct PagedArgs {
  const float* query;       // (B, Hq, n, d) fp32, contiguous
  float* out;               // (B, Hq, n, dv) fp32, contiguous
  const uint8_t* arena;     // (num_pages, page_bytes)
  int64_t page_bytes;
  const int64_t* exact_table;  // (B, pe): each row's exact pages, oldest first
  int64_t pe;
  const int64_t* q_table;      // (B, pq): each row's quantized pages
  int64_t pq;
  const int32_t* ranges;    // (B, n, rstride): per query token q, lo, hi[, q0[, s0, s1]]: quantized tokens seen [q0, q)
                            // (q0 = 0 without a fourth column) and exact tokens [lo, hi)
  int64_t rstride;          // 3; 4 with each token's first code seen (a window's start); 6 with the sinks [s0, s1) of the
                            // sink tier (quantized when tq > 0, else exact)
  const float* rotation;    // (d, d) Hadamard rotation of the quantized tier, or nullptr; a latent's is block-diagonal
                            // (the latent's rotation, then the rope key's: each stream is rotated on its own)
  const float* query_rot;   // (B, Hq, n, d) the query times `rotation` (with one), else nullptr
  int64_t B, Hq, H, n, d, dv;
  int kv_dtype;             // DType of the exact tier
  int64_t te, k_off, v_off; // exact tokens per page, byte offsets of layer's K and V slabs (heads, te, width)
  int64_t kw, vw;           // elements per token of the K and V slabs: d and dv, or in the latent form dv and d - dv
  bool latent;              // a native-MLA latent (absorbed attention, MQA): the key is the K slab's token (the
                            // latent c, kw = dv wide) followed by the V slab's (the rope key, vw = d - dv), the
                            // value the K slab's token alone
  int64_t tq, group;        // quantized tokens per page (0: none), key group size (tokens)
  int k_bits, v_bits;       // 8 or 4
  int ks_dtype, vs_dtype;   // DType of the scales and zero points
  int64_t kc_off, ks_off, kz_off, vc_off, vs_off, vz_off;  // byte offsets of the quantized slabs: the keys' codes,
                            // scales and zero points (per channel over groups), the values' (per token); a latent's:
                            // the latent's, then the rope key's, both per channel over groups
  bool posthoc;             // a post-hoc latent (mla on an MHA/GQA model): the K slab holds one head's latent c_t
                            // (kw = r wide, no V slab), read by each of the model's H KV heads: its key rebuilt in a
                            // block's scratch, RoPE_pos(c_t P_h + mu_h); its value absorbed (c_t summed, projected
                            // once a row) or rebuilt (c_t P_v,h + mu_v,h)
  const float* key_up;      // posthoc: (H, r, d) each KV head's key basis P_h
  const float* key_mean;    // posthoc: (H, d) each KV head's key mean mu_h
  const float* key_up_rot;  // posthoc with a rotated quantized tier (codes of c R, R a Hadamard rotation, its own
  const float* value_up_rot;// inverse): (H, r, d) R P_h, the bases its codes are rebuilt and projected with; with
                            // them `rotation` is set (R, r x r) and that tier's weighted latents sum apart (acc_q)
  const float* value_up;    // posthoc: (H, r, d) each KV head's value basis, (H, d) its mean: applied to a row's
  const float* value_mean;  // weighted latent when it is written out, or to each token's latent (rebuild_values)
  bool rebuild_values;      // posthoc: values rebuilt per block (dv = d), cheaper than summing the latent for many
                            // rows a tile (a prefill's); else the latent is summed (dv = r) and projected once a row
  int64_t ow;               // elements per output row: dv, or a post-hoc latent's head_dim (under a dca source: H
                            // head_dim, every head's values side by side)
  int64_t hd;               // posthoc, mixed: a KV head's key width (head_dim): d, or a dca source's query's w
  bool mixed;               // a dca reuse layer's source (form 0 pages, K/V of H heads of width kw): each query row of
                            // KV head h is [the query folded through the map for each source head g ; the query]
                            // (d = (H + 1) kw); its key at token t is [K_0,t ; ... ; K_H-1,t ; RoPE_pos(b_h)], its
                            // value [V_0,t ; ... ; V_H-1,t] (dv = H kw): every source head scored and summed at once,
                            // a block widened once for every query head (kv_items 1), the bias part scored apart
  const float* key_bias;    // mixed: (H, hd) the map's pre-RoPE key bias per destination head; mixed and posthoc
                            // together: a dca source held as a post-hoc latent (dca+mla), every head's keys rebuilt
  float* lse;               // (B, Hq, n) each row's log-sum-exp of its scaled scores (-inf: no token seen), or nullptr
  const int64_t* positions; // posthoc: (B, pos_stride) every slot's position, the quantized tier's pq * tq first
  int64_t pos_stride;
  const float* cos;         // posthoc: (rope_rows, d) RoPE's cos and sin per position (rows past the end: the last)
  const float* sin;
  int64_t rope_rows;
  float scaling;            // softmax scale
  bool int_sums;            // a decode's 4-bit keys scored in integers (the query rounded to int8 once per key
                            // group); false: fp32 sums throughout (KVSERVE_KERNEL_EXACT_SUMS=1)
  int64_t kv_items;         // work items per row and query tile: one per KV head (H), or one for every head (a dca
                            // source: every query head's rows read the same widened block of every source head)
  int64_t tile_tokens;      // query tokens per work item
  int64_t tiles;            // ceil(n / tile_tokens)
  int64_t splits;           // work units per item (its KV blocks split between them), 1: none
  float* partial;           // splits > 1: (items * splits, part_stride) running max, sum and accumulators
  int64_t part_stride;
};

// Work units [begin, end): split u % splits of item u / splits (row b, KV head h, query tile), b-major.
void paged_attention_avx2(const PagedArgs& a, int64_t begin, int64_t end);
void paged_attention_portable(const PagedArgs& a, int64_t begin, int64_t end);
// Items [begin, end) with splits > 1: their units' partial results combined into the output.
void paged_merge_avx2(const PagedArgs& a, int64_t begin, int64_t end);
void paged_merge_portable(const PagedArgs& a, int64_t begin, int64_t end);
// Columns [n0, n1) of y (M x N) = x (M x K) w^T (w: N x K, row-major) + bias (nullptr: none); fp32, AVX2 + FMA.
void skinny_linear_avx2(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                        int64_t n0, int64_t n1);

}  // namespace kvserve
