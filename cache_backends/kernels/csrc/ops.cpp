// kvserve's custom ops (torch.library): `kvserve::paged_write`, a step's new K/V copied into their exact slots, and
// `kvserve::paged_attention`, attention of a step's queries over one layer's
// K/V read in place from the paged pool, every stored form (exact fp32/bf16/fp16 pages, int8/int4/k8v4 codes with
// their scales, a Hadamard-rotated tier, the exact residual window; a native-MLA latent and rope key, exact or
// int8/int4 per channel over groups) in one call; `kvserve::paged_latent_attention`, the same over a post-hoc latent
// (mla on an MHA/GQA model), its keys rebuilt block by block inside the op; `kvserve::paged_dca_attention`, a dca
// reuse layer's: its source's pages with the layer's map folded in (every source head scored at once) and its own
// pages, merged into one softmax; `kvserve::paged_mapped_attention`, paged_attention with gqa's read-backs around
// it; `kvserve::paged_grouped_write` and `kvserve::paged_latent_write`, a step's new K/V encoded into gqa's shared
// heads or a post-hoc latent and written. The kernel is chosen once per process from
// what the CPU reports (AVX2 + FMA + F16C, else portable C++) and split over the work items (row, KV head, query
// tile) with at::parallel_for.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "paged_args.h"

namespace kvserve {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool use_avx2() {
  static const bool yes = cpu_has_avx2() && std::getenv("KVSERVE_KERNEL_PORTABLE") == nullptr;
  return yes;
}

// Work units per item: with fewer items (rows x KV heads x query tiles) than twice the threads, as in a decode of
// one or a few rows, each item's KV blocks are split between units so that every thread has work (at least 512
// tokens a unit). KVSERVE_KERNEL_SPLITS=<n> sets the count instead (the tests use it to cover the merge).
#ifndef KVK_TILE_ROWS
// Query rows of one work item (a tile of prompt tokens times the query heads of one KV head): every stored token
// a prefill tile reads that is not fp32 is widened once per tile, so larger tiles widen less often.
#define KVK_TILE_ROWS 96
#endif

#ifndef KVK_POSTHOC_TILE_ROWS
#define KVK_POSTHOC_TILE_ROWS 384
#endif

int64_t splits_for(const PagedArgs& a, int64_t items) {
  if (const char* forced = std::getenv("KVSERVE_KERNEL_SPLITS")) return std::max<int64_t>(1, std::atoll(forced));
  const int64_t threads = at::get_num_threads();
  if (items >= 2 * threads) return 1;
  int64_t longest = 0;
  for (int64_t t = 0; t < a.B * a.n; ++t) {
    const int32_t* rg = a.ranges + t * a.rstride;
    const int64_t q0 = a.rstride > 3 ? std::min(rg[3], rg[0]) : 0;
    const int64_t sinks = a.rstride > 5 ? std::max(rg[5] - rg[4], 0) : 0;
    longest = std::max<int64_t>(longest, rg[0] - q0 + std::max(rg[2] - rg[1], 0) + sinks);
  }
  return std::max<int64_t>(1, std::min<int64_t>((2 * threads + items - 1) / items, longest / 512));
}

// layout: page_bytes, heads, k_width, v_width, kv_dtype, te, k_off, v_off, tq, group, k_bits, v_bits, ks_dtype,
// vs_dtype, kc_off, ks_off, kz_off, vc_off, vs_off, vz_off, form. form 0: a K/V pair (paged_attention). form 2: a
// post-hoc latent (paged_latent_attention). form 1: a native-MLA model's
// latent (absorbed attention, DeepSeek-V2 arXiv 2405.04434 section 2.1.2): the K slab holds the latent c_t (k_width
// = r), the V slab the shared rope key (v_width = rope), one head each; the query is (q_latent, q_rope), d = r + rope
// wide, every query head shares the one KV head (MQA), the key is (c_t, k_rope_t) and the value c_t: out is r wide.
// A latent's quantized tier holds both streams per channel over groups: kc/ks/kz the latent's codes, scales and
// zero points, vc/vs/vz the rope key's (k_bits and v_bits their code widths, ks_dtype and vs_dtype their scales').
constexpr int64_t LAYOUT_LEN = 21;

// What both attention ops check and fill alike: the query, the pool, the block tables and ranges, the layout's
// slabs and tiers. The tensors hold the contiguous copies the pointers in `a` point into.
struct Call {
  PagedArgs a{};
  torch::Tensor q, et, qt, rg, out, pos, cos, sin, rot, q_rot, bias;
  std::vector<torch::Tensor> keep;  // the fp32 copies of a post-hoc latent's bases the pointers in `a` point into
};

void prepare(Call& call, const torch::Tensor& query, const torch::Tensor& arena, const torch::Tensor& exact_table,
             const torch::Tensor& q_table, const torch::Tensor& ranges, at::IntArrayRef layout, double scaling) {
  TORCH_CHECK(query.device().is_cpu(), "kvserve's attention ops run on the CPU");
  TORCH_CHECK(query.dim() == 4, "query must be (B, Hq, n, d)");
  TORCH_CHECK(layout.size() == LAYOUT_LEN, "layout must have ", LAYOUT_LEN, " entries");
  TORCH_CHECK(arena.scalar_type() == torch::kUInt8 && arena.dim() == 2 && arena.is_contiguous(),
              "arena must be a contiguous (num_pages, page_bytes) uint8 tensor");
  TORCH_CHECK(exact_table.scalar_type() == torch::kLong && q_table.scalar_type() == torch::kLong,
              "block tables must be int64");
  TORCH_CHECK(ranges.scalar_type() == torch::kInt && ranges.dim() == 3 &&
                  (ranges.size(2) == 3 || ranges.size(2) == 4 || ranges.size(2) == 6),
              "ranges must be (B, n, 3), (B, n, 4) or (B, n, 6) int32");
  PagedArgs& a = call.a;
  call.q = query.to(torch::kFloat).contiguous();
  call.et = exact_table.contiguous();
  call.qt = q_table.contiguous();
  call.rg = ranges.contiguous();
  const auto& q = call.q;
  a.B = q.size(0);
  a.Hq = q.size(1);
  a.n = q.size(2);
  a.d = q.size(3);
  a.page_bytes = layout[0];
  const char* exact = std::getenv("KVSERVE_KERNEL_EXACT_SUMS");  // set, and neither empty nor "0": fp32 sums
  a.int_sums = exact == nullptr || exact[0] == '\0' || (exact[0] == '0' && exact[1] == '\0');
  a.H = layout[1];
  TORCH_CHECK(arena.size(1) == a.page_bytes, "the arena's pages are not page_bytes long");
  TORCH_CHECK(call.et.size(0) == a.B && call.qt.size(0) == a.B && call.rg.size(0) == a.B && call.rg.size(1) == a.n,
              "block tables and ranges must have one row per query row");
  a.kv_dtype = static_cast<int>(layout[4]);
  a.te = layout[5];
  a.k_off = layout[6];
  a.v_off = layout[7];
  a.tq = layout[8];
  a.group = layout[9];
  a.k_bits = static_cast<int>(layout[10]);
  a.v_bits = static_cast<int>(layout[11]);
  a.ks_dtype = static_cast<int>(layout[12]);
  a.vs_dtype = static_cast<int>(layout[13]);
  a.kc_off = layout[14];
  a.ks_off = layout[15];
  a.kz_off = layout[16];
  a.vc_off = layout[17];
  a.vs_off = layout[18];
  a.vz_off = layout[19];
  TORCH_CHECK(a.te > 0, "an exact page must hold a token");
  TORCH_CHECK(a.tq == 0 || (a.group > 0 && a.tq % a.group == 0), "quantized pages hold whole groups");
  a.query = q.data_ptr<float>();
  a.arena = arena.data_ptr<uint8_t>();
  a.exact_table = call.et.data_ptr<int64_t>();
  a.pe = call.et.size(1);
  a.q_table = call.qt.data_ptr<int64_t>();
  a.pq = call.qt.size(1);
  a.ranges = call.rg.data_ptr<int32_t>();
  a.rstride = call.rg.size(2);
  a.scaling = static_cast<float>(scaling);
}

// The work items of a prepared call (a.H and a.dv set) over the engine's threads, then their splits merged; returns
// the output in the query's dtype.
torch::Tensor run(Call& call, const torch::Tensor& query) {
  PagedArgs& a = call.a;
  TORCH_CHECK(a.H > 0 && a.Hq % a.H == 0, "query heads must be a multiple of the KV heads");
  a.kv_items = a.mixed ? 1 : a.H;  // a dca source: one item reads every head's block for every query head
  const int64_t rep = a.Hq / a.kv_items;
  // a post-hoc latent's and a dca source's tiles are larger: every tile rebuilds (widens every head of) the keys it
  // reads, so fewer tiles do it less often
  a.tile_tokens = std::max<int64_t>(1, (a.posthoc || a.mixed ? KVK_POSTHOC_TILE_ROWS : KVK_TILE_ROWS) / rep);
  if (a.posthoc && !a.mixed) {
    // per token and KV head, summing the latent costs r a row, rebuilding the values r * d once and d a row: the
    // values are rebuilt where a tile's rows make that cheaper (a prefill chunk at a rank above head_dim)
    const int64_t r = a.kw, d = a.d, rows = std::min(a.n, a.tile_tokens) * rep;
    a.rebuild_values = r > d && rows * (r - d) > r * d;
    a.dv = a.rebuild_values ? d : r;
    a.ow = d;
  } else if (a.posthoc) {  // a dca source held as a latent: the latent summed, every head's values projected from it
    a.rebuild_values = false;
    a.dv = a.kw;
    a.ow = a.H * a.hd;
  } else {
    a.ow = a.dv;
  }
  call.out = torch::empty({a.B, a.Hq, a.n, a.ow}, call.q.options());
  a.out = call.out.data_ptr<float>();
  a.tiles = (a.n + a.tile_tokens - 1) / a.tile_tokens;
  const int64_t items = a.B * a.kv_items * a.tiles;
  a.splits = splits_for(a, items);
  std::vector<float> partial;
  if (a.splits > 1) {
    const int64_t R = a.tile_tokens * rep;
    a.part_stride = R * (2 + a.dv * (a.rotation != nullptr ? 2 : 1));
    partial.resize(items * a.splits * a.part_stride);
    a.partial = partial.data();
  }
  const bool avx2 = use_avx2();
  at::parallel_for(0, items * a.splits, 1, [&](int64_t begin, int64_t end) {
    if (avx2) {
      paged_attention_avx2(a, begin, end);
    } else {
      paged_attention_portable(a, begin, end);
    }
  });
  if (a.splits > 1)
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      if (avx2) {
        paged_merge_avx2(a, begin, end);
      } else {
        paged_merge_portable(a, begin, end);
      }
    });
  return query.scalar_type() == torch::kFloat ? call.out : call.out.to(query.scalar_type());
}

// Each slot's position and RoPE's tables, checked and pointed at (the ops that rotate inside: a post-hoc latent's
// keys, a dca source's key bias); the contiguous copies kept in `call`.
void rope_args(Call& call, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
               int64_t width) {
  PagedArgs& a = call.a;
  call.pos = positions.contiguous();
  call.cos = cos.to(torch::kFloat).contiguous();
  call.sin = sin.to(torch::kFloat).contiguous();
  const auto &pos = call.pos, &c = call.cos;
  TORCH_CHECK(width % 2 == 0 && c.dim() == 2 && c.size(1) == width && call.sin.sizes() == c.sizes() && c.size(0) > 0,
              "cos and sin must be (rows, d), d even");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.dim() == 2 && pos.size(0) == a.B &&
                  pos.size(1) == a.pq * a.tq + a.pe * a.te,
              "positions must be (B, pq * tq + pe * te) int64: every slot of the row's quantized then exact pages");
  a.positions = pos.data_ptr<int64_t>();
  a.pos_stride = pos.size(1);
  a.cos = c.data_ptr<float>();
  a.sin = call.sin.data_ptr<float>();
  a.rope_rows = c.size(0);
}

// Each row's log-sum-exp of its scaled scores, (B, Hq, n) fp32, written by the call's work (a.lse pointed at it).
torch::Tensor lse_of(Call& call) {
  auto lse = torch::empty({call.a.B, call.a.Hq, call.a.n}, call.q.options());
  call.a.lse = lse.data_ptr<float>();
  return lse;
}

// prepare(), then the layout's form: a K/V pair (form 0) or a native-MLA latent and rope key (form 1).
void prepare_pair(Call& call, const torch::Tensor& query, const torch::Tensor& arena, const torch::Tensor& exact_table,
                  const torch::Tensor& q_table, const torch::Tensor& ranges, at::IntArrayRef layout, double scaling) {
  prepare(call, query, arena, exact_table, q_table, ranges, layout, scaling);
  PagedArgs& a = call.a;
  a.latent = layout[20] == 1;
  TORCH_CHECK(layout[20] == 0 || layout[20] == 1, "layout's form must be 0 (K/V) or 1 (latent)");
  if (a.latent) {
    TORCH_CHECK(layout[2] + layout[3] == a.d, "the query's width must be the latent's plus the rope key's");
    a.dv = layout[2];
    a.kw = layout[2];
    a.vw = layout[3];
  } else {
    TORCH_CHECK(layout[2] == a.d, "the query's head_dim must be the keys' width");
    a.dv = layout[3];
    a.kw = a.d;
    a.vw = a.dv;
  }
}

// A prepared call over a post-hoc latent (form 2: the layout's one stream is the latent c_t, one head,
// k_width = r, no V slab) read by each of the model's H KV heads: key_up, value_up (H, r, hd); key_mean, value_mean
// (H, hd); hd the heads' width; with a rotated quantized tier (codes of c R) rotated_bases (2, H, r, hd), R P_k and
// R P_v, that tier's codes are rebuilt and projected with (summed apart).
void latent_args(Call& call, at::IntArrayRef layout, const torch::Tensor& key_up, const torch::Tensor& key_mean,
                 const torch::Tensor& value_up, const torch::Tensor& value_mean, const torch::Tensor* rotated_bases,
                 int64_t hd) {
  PagedArgs& a = call.a;
  TORCH_CHECK(layout[20] == 2, "layout's form must be 2 (a post-hoc latent)");
  TORCH_CHECK(layout[1] == 1 && layout[3] == 0, "a post-hoc latent is one stream of one head");
  TORCH_CHECK(a.rstride != 6, "a post-hoc latent has no attention sinks");
  auto up = key_up.to(torch::kFloat).contiguous(), mean = key_mean.to(torch::kFloat).contiguous();
  TORCH_CHECK(up.dim() == 3 && up.size(1) == layout[2] && up.size(2) == hd,
              "key_up must be (H, r, d): r the latent's width, d the query's head_dim");
  TORCH_CHECK(mean.dim() == 2 && mean.size(0) == up.size(0) && mean.size(1) == hd, "key_mean must be (H, d)");
  auto v_up = value_up.to(torch::kFloat).contiguous(), v_mean = value_mean.to(torch::kFloat).contiguous();
  TORCH_CHECK(v_up.sizes() == up.sizes() && v_mean.sizes() == mean.sizes(),
              "value_up and value_mean must be (H, r, d) and (H, d), as key_up and key_mean");
  a.posthoc = true;
  a.H = up.size(0);
  a.hd = hd;
  a.kw = layout[2];
  a.vw = 0;
  a.dv = layout[2];  // run() sets the accumulators' width: r, or d where the values are rebuilt
  a.key_up = up.data_ptr<float>();
  a.key_mean = mean.data_ptr<float>();
  a.value_up = v_up.data_ptr<float>();
  a.value_mean = v_mean.data_ptr<float>();
  call.keep.insert(call.keep.end(), {up, mean, v_up, v_mean});
  if (rotated_bases != nullptr && rotated_bases->defined()) {  // a rotated quantized tier: (2, H, r, d), R P_k, R P_v
    auto rot = rotated_bases->to(torch::kFloat).contiguous();
    TORCH_CHECK(rot.dim() == 4 && rot.size(0) == 2 && rot.size(1) == up.size(0) && rot.size(2) == up.size(1) &&
                    rot.size(3) == hd, "rotated_bases must be (2, H, r, d): R P_k and R P_v");
    a.key_up_rot = rot.data_ptr<float>();
    a.value_up_rot = a.key_up_rot + up.numel();
    a.rotation = a.key_up_rot;  // marks the tier as summed apart; a post-hoc latent never reads it as R
    call.keep.push_back(rot);
  }
}

// Point a prepared call at a rotated quantized tier: `rot` (d, d) (R's blocks), the query times it once per row.
void rotate_query(Call& call, const torch::Tensor& rot) {
  call.rot = rot.to(torch::kFloat).contiguous();
  call.q_rot = at::matmul(call.q, call.rot).contiguous();  // once per query row, not once per work unit that reads it
  call.a.rotation = call.rot.data_ptr<float>();
  call.a.query_rot = call.q_rot.data_ptr<float>();
}

// A dca reuse layer's ranges (B, n, 3 or 4) cut at each row's first own position, four entries a row in `cuts`:
// `from` (its own pages): each query's first exact slot raised to cuts[4b] and its first code to cuts[4b + 1] (four
// columns out); else (its source's): its exact slots ended at cuts[4b + 2] and its codes at cuts[4b + 3].
torch::Tensor cut_ranges(const torch::Tensor& ranges, at::IntArrayRef cuts, bool from) {
  TORCH_CHECK(ranges.scalar_type() == torch::kInt && ranges.dim() == 3 && (ranges.size(2) == 3 || ranges.size(2) == 4),
              "a dca layer's ranges must be (B, n, 3) or (B, n, 4) int32: no attention sinks");
  const int64_t B = ranges.size(0), n = ranges.size(1), s = ranges.size(2), os = from ? 4 : s;
  TORCH_CHECK(static_cast<int64_t>(cuts.size()) == 4 * B, "cuts must hold four entries a row");
  auto in = ranges.contiguous();
  auto out = torch::empty({B, n, os}, in.options());
  const int32_t* r = in.data_ptr<int32_t>();
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      const int32_t* src = r + (b * n + i) * s;
      int32_t* dst = o + (b * n + i) * os;
      std::copy(src, src + s, dst);
      if (from) {
        if (s == 3) dst[3] = 0;
        dst[1] = std::max<int32_t>(dst[1], static_cast<int32_t>(cuts[4 * b]));
        dst[3] = std::max<int32_t>(dst[3], static_cast<int32_t>(cuts[4 * b + 1]));
      } else {
        dst[2] = std::min<int32_t>(dst[2], static_cast<int32_t>(cuts[4 * b + 2]));
        dst[0] = std::min<int32_t>(dst[0], static_cast<int32_t>(cuts[4 * b + 3]));
      }
    }
  return out;
}

// Both parts of a reuse layer hold the inner backend's stored form: K/V pairs of `w`-wide heads (form 0), or a
// post-hoc latent (form 2, `latent`).
void check_part(at::IntArrayRef layout, int64_t w, bool latent, const char* which) {
  TORCH_CHECK(layout.size() == LAYOUT_LEN, which, " must have ", LAYOUT_LEN, " entries");
  if (latent) {
    TORCH_CHECK(layout[20] == 2, which, " must be a post-hoc latent (form 2), as the other part's");
  } else {
    TORCH_CHECK(layout[20] == 0 && layout[2] == w && layout[3] == w, which,
                " must be a K/V pair (form 0) with keys and values as wide as the query's head_dim");
  }
}

// A dca reuse layer's attention, in one op (cache_backends/dca/paged.py, attend_in_place_through_map): each query
// (B, Hq, n, w) reads the positions before its row's first own position from its source layer's pages, the map
// folded in, and those from it on from the layer's own pages, both in place, in one softmax. With a map (`map`:
// key_fold (Hq, w, H w), value_map (Hq, H w, w), value_bias (Hq, w), key_bias (H, w), cos and sin (rows, w)) the
// source's part scores every source head at once: row [q key_fold_0 ; ... ; q key_fold_H-1 ; q] against
// [K_0,t ; ... ; K_H-1,t ; RoPE_pos(b_h)] (the key bias rotated to each token's position, src_positions), its
// values [V_0,t ; ... ; V_H-1,t] summed, then mapped once a row (value_map, plus value_bias); with none (an empty
// `map`) the source's K/V as they are. The two parts are attended apart and merged by their log-sum-exp
// (FlashAttention's rescaling, arXiv 2205.14135). A rotated quantized tier (rotation (w, w), R symmetric): each
// part's query rotated (a folded row block by block, its bias part not), its weighted codes summed apart.
// Under dca+mla both parts are post-hoc latents (`latents`: the source layer's key_up, key_mean, value_up,
// value_mean, the layer's own, then cos and sin (rows, w) for the rebuilt keys; not a rotated tier, which dca+mla
// never stores): every source head's keys rebuilt from the latent (RoPE at each slot's position), the
// latent summed as the values and each head's projected once a row; the layer's own as paged_latent_attention.
torch::Tensor paged_dca_attention(const torch::Tensor& query, const torch::Tensor& src_arena,
                                  const torch::Tensor& src_exact_table, const torch::Tensor& src_q_table,
                                  const torch::Tensor& src_ranges, at::IntArrayRef src_layout,
                                  const torch::Tensor& src_positions, const torch::Tensor& own_arena,
                                  const torch::Tensor& own_exact_table, const torch::Tensor& own_q_table,
                                  const torch::Tensor& own_ranges, at::IntArrayRef own_layout,
                                  const torch::Tensor& own_positions, at::IntArrayRef cuts,
                                  const std::optional<torch::Tensor>& rotation, at::TensorList map,
                                  at::TensorList latents, double scaling) {
  TORCH_CHECK(query.dim() == 4, "query must be (B, Hq, n, d)");
  const auto q = query.to(torch::kFloat).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), w = q.size(3);
  const bool latent = !latents.empty();
  TORCH_CHECK(!latent || latents.size() == 10,
              "latents must be [the source's 4 bases, the layer's 4, cos, sin] or empty");
  check_part(src_layout, w, latent, "the source's layout");
  check_part(own_layout, w, latent, "the layer's own layout");
  torch::Tensor rot;
  if (rotation.has_value() && rotation->defined()) {
    TORCH_CHECK(!latent, "a post-hoc latent under dca has no rotated tier");
    rot = rotation->to(torch::kFloat).contiguous();
    TORCH_CHECK(rot.dim() == 2 && rot.size(0) == w && rot.size(1) == w, "rotation must be (head_dim, head_dim)");
  }
  const auto rotates = [&](at::IntArrayRef layout, const torch::Tensor& q_table) {
    return rot.defined() && layout[8] > 0 && q_table.size(1) > 0;
  };
  // a latent part: its layer's bases (first: 0 the source, 4 the layer)
  const auto as_latent = [&](Call& call, at::IntArrayRef layout, int64_t first, const torch::Tensor& positions,
                             const torch::Tensor& cos, const torch::Tensor& sin) {
    latent_args(call, layout, latents[first], latents[first + 1], latents[first + 2], latents[first + 3], nullptr, w);
    rope_args(call, positions, cos, sin, w);
  };

  // a part attended as its layer stores it, without a map: a latent's own op, or a K/V pair's (rotated or not)
  const auto as_stored = [&](Call& call, const torch::Tensor& arena, const torch::Tensor& exact_table,
                             const torch::Tensor& q_table, const torch::Tensor& ranges, at::IntArrayRef layout,
                             const torch::Tensor& positions, int64_t first) {
    if (latent) {
      prepare(call, q, arena, exact_table, q_table, ranges, layout, scaling);
      as_latent(call, layout, first, positions, latents[8], latents[9]);
    } else {
      prepare_pair(call, q, arena, exact_table, q_table, ranges, layout, scaling);
      if (rotates(layout, q_table)) rotate_query(call, rot);
    }
  };

  Call own;  // the layer's own tokens
  as_stored(own, own_arena, own_exact_table, own_q_table, cut_ranges(own_ranges, cuts, true), own_layout,
            own_positions, 4);
  const auto own_lse = lse_of(own);
  const auto own_out = run(own, q);  // fp32, (B, Hq, n, w)

  Call src;  // the source's tokens
  const auto src_cut = cut_ranges(src_ranges, cuts, false);
  torch::Tensor src_out, value_map, value_bias;
  if (map.empty()) {
    as_stored(src, src_arena, src_exact_table, src_q_table, src_cut, src_layout, src_positions, 0);
  } else {
    TORCH_CHECK(map.size() == 6, "map must be [key_fold, value_map, value_bias, key_bias, cos, sin] or empty");
    const int64_t H = latent ? latents[0].size(0) : src_layout[1];
    const auto key_fold = map[0].to(torch::kFloat);
    value_map = map[1].to(torch::kFloat);
    value_bias = map[2].to(torch::kFloat);
    TORCH_CHECK(key_fold.dim() == 3 && key_fold.size(0) == Hq && key_fold.size(1) == w && key_fold.size(2) == H * w,
                "key_fold must be (Hq, head_dim, H * head_dim)");
    TORCH_CHECK(value_map.dim() == 3 && value_map.size(0) == Hq && value_map.size(1) == H * w &&
                    value_map.size(2) == w, "value_map must be (Hq, H * head_dim, head_dim)");
    TORCH_CHECK(value_bias.dim() == 2 && value_bias.size(0) == Hq && value_bias.size(1) == w,
                "value_bias must be (Hq, head_dim)");
    const auto folded = at::cat({at::matmul(q, key_fold), q}, -1).contiguous();  // (B, Hq, n, (H + 1) w)
    prepare(src, folded, src_arena, src_exact_table, src_q_table, src_cut, src_layout, scaling);
    PagedArgs& a = src.a;
    if (latent) {  // keys rebuilt and rotated with the map's RoPE tables, as its key bias
      as_latent(src, src_layout, 0, src_positions, map[4], map[5]);
    } else {
      rope_args(src, src_positions, map[4], map[5], w);
      a.kw = w;
      a.vw = w;
      a.dv = a.H * w;
      a.hd = w;
    }
    auto bias = map[3].to(torch::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 2 && bias.size(0) == a.H && bias.size(1) == w, "key_bias must be (H, head_dim)");
    src.bias = bias;
    a.mixed = true;
    a.key_bias = src.bias.data_ptr<float>();
    if (rotates(src_layout, src_q_table)) {  // R on each source head's block, the bias's block as it is
      auto blocks = torch::eye((a.H + 1) * w, rot.options());
      for (int64_t g = 0; g < a.H; ++g) blocks.narrow(0, g * w, w).narrow(1, g * w, w).copy_(rot);
      rotate_query(src, blocks);
    }
  }
  const auto src_lse = lse_of(src);
  src_out = run(src, src.q);
  if (!map.empty()) src_out = at::matmul(src_out, value_map) + value_bias.unsqueeze(1);  // normalized:
  src_out = src_out.contiguous();                                                          // the bias adds whole

  auto out = torch::empty({B, Hq, n, w}, q.options());
  const float *o = own_out.data_ptr<float>(), *s = src_out.data_ptr<float>();
  const float *lo = own_lse.data_ptr<float>(), *ls = src_lse.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, B * Hq * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float m = std::max(lo[row], ls[row]);
      // a row that saw nothing is zero, as on the torch path
      const bool any = m > -std::numeric_limits<float>::infinity();
      const float wo = any ? std::exp(lo[row] - m) : 0.f, ws = any ? std::exp(ls[row] - m) : 0.f;
      const float inv = any ? 1.f / (wo + ws) : 0.f;
      for (int64_t c = 0; c < w; ++c) {
        const float a = wo > 0.f ? wo * o[row * w + c] : 0.f, b = ws > 0.f ? ws * s[row * w + c] : 0.f;
        dst[row * w + c] = (a + b) * inv;
      }
    }
  });
  return query.scalar_type() == torch::kFloat ? out : out.to(query.scalar_type());
}

torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& arena, const torch::Tensor& exact_table,
                              const torch::Tensor& q_table, const torch::Tensor& ranges, at::IntArrayRef layout,
                              const std::optional<torch::Tensor>& rotation, double scaling) {
  Call call;
  prepare_pair(call, query, arena, exact_table, q_table, ranges, layout, scaling);
  PagedArgs& a = call.a;
  if (rotation.has_value() && rotation->defined()) {
    TORCH_CHECK(rotation->dim() == 2 && rotation->size(0) == a.d && rotation->size(1) == a.d &&
                    (a.d == a.dv || a.latent),
                "rotation must be (d, d), d == dv (a latent's: block-diagonal, the latent's then the rope key's)");
    rotate_query(call, *rotation);
  }
  return run(call, query);
}

// gqa's attention (post-hoc head sharing, GQA arXiv 2305.13245) in one op: each query head's key read-back folded
// into its query, q_h M_h^T (query_map (Hq, e, d): e the shared heads' width), paged_attention over the shared heads'
// pages, then each head's value read-back applied to its output, o_h O_h (output_map (Hq, e, d)); (B, Hq, n, d) out.
torch::Tensor paged_mapped_attention(const torch::Tensor& query, const torch::Tensor& arena,
                                     const torch::Tensor& exact_table, const torch::Tensor& q_table,
                                     const torch::Tensor& ranges, at::IntArrayRef layout,
                                     const std::optional<torch::Tensor>& rotation, const torch::Tensor& query_map,
                                     const torch::Tensor& output_map, double scaling) {
  TORCH_CHECK(query.dim() == 4, "query must be (B, Hq, n, d)");
  const int64_t Hq = query.size(1), d = query.size(3);
  const auto qm = query_map.to(torch::kFloat), om = output_map.to(torch::kFloat);
  TORCH_CHECK(qm.dim() == 3 && qm.size(0) == Hq && qm.size(2) == d, "query_map must be (Hq, e, d)");
  TORCH_CHECK(om.dim() == 3 && om.size(0) == Hq && om.size(1) == qm.size(1), "output_map must be (Hq, e, d_out)");
  const auto q = at::matmul(query.to(torch::kFloat), qm.transpose(1, 2)).contiguous();  // (B, Hq, n, e)
  const auto out = at::matmul(paged_attention(q, arena, exact_table, q_table, ranges, layout, rotation, scaling), om);
  return out.to(query.scalar_type());
}

// Attention over a post-hoc latent (form 2: ``mla`` on an MHA/GQA model) read in place: the layout's one stream is
// the latent c_t (one head, k_width = r, no V slab); each of the model's H KV heads (key_up, value_up (H, r, d);
// key_mean, value_mean (H, d)) scores its query heads against keys rebuilt block by block, RoPE_pos(c_t P_h + mu_h)
// at each slot's position (positions (B, pq * tq + pe * te) int64; cos and sin (rows, d)), and takes as values the
// latent summed then projected once a row, (Σ p c) P_v,h + mu_v,h, or, where a tile's rows make it cheaper, values
// rebuilt block by block: the output is (B, Hq, n, d), the attention's.
torch::Tensor paged_latent_attention(const torch::Tensor& query, const torch::Tensor& arena,
                                     const torch::Tensor& exact_table, const torch::Tensor& q_table,
                                     const torch::Tensor& ranges, at::IntArrayRef layout, const torch::Tensor& key_up,
                                     const torch::Tensor& key_mean, const torch::Tensor& value_up,
                                     const torch::Tensor& value_mean, const torch::Tensor& positions,
                                     const torch::Tensor& cos, const torch::Tensor& sin,
                                     const std::optional<torch::Tensor>& rotated_bases, double scaling) {
  Call call;
  prepare(call, query, arena, exact_table, q_table, ranges, layout, scaling);
  const torch::Tensor* rot = rotated_bases.has_value() ? &*rotated_bases : nullptr;
  latent_args(call, layout, key_up, key_mean, value_up, value_mean, rot, call.a.d);
  rope_args(call, positions, cos, sin, call.a.d);
  return run(call, query);
}

// gqa's write in one op: each group of m = H / G heads' K (and V) concatenated, (m d), times the group's encoder
// (key_encode, value_encode (G, m d, d)), then written as paged_write writes (key, value (B, H, n, d)).
void paged_write(torch::Tensor arena, const torch::Tensor& key, const torch::Tensor& value,
                 const torch::Tensor& write_pages, const torch::Tensor& write_slots, at::IntArrayRef layout);

void paged_grouped_write(torch::Tensor arena, const torch::Tensor& key, const torch::Tensor& value,
                         const torch::Tensor& key_encode, const torch::Tensor& value_encode,
                         const torch::Tensor& write_pages, const torch::Tensor& write_slots, at::IntArrayRef layout) {
  TORCH_CHECK(key.dim() == 4 && value.sizes() == key.sizes(), "key and value must be (B, H, n, d) alike");
  const int64_t B = key.size(0), H = key.size(1), n = key.size(2), d = key.size(3), G = key_encode.size(0);
  TORCH_CHECK(key_encode.dim() == 3 && G > 0 && H % G == 0 && key_encode.size(1) == H / G * d &&
                  value_encode.sizes() == key_encode.sizes(), "key_encode and value_encode must be (G, H / G * d, e)");
  const auto encode = [&](const torch::Tensor& x, const torch::Tensor& e) {
    const auto grouped = x.reshape({B, G, H / G, n, d}).permute({0, 1, 3, 2, 4}).reshape({B, G, n, H / G * d});
    return at::matmul(grouped.to(e.scalar_type()), e).to(x.scalar_type());  // (B, G, n, e)
  };
  paged_write(arena, encode(key, key_encode), encode(value, value_encode), write_pages, write_slots, layout);
}

// Write a step's new K/V (B, H, n, width each, the pool's dtype) into their exact slots: token (b, i) of head h at
// slot write_slots[b * n + i] of page write_pages[b * n + i], in the layer's K and V slabs (a native-MLA layout's
// latent and rope key alike: one head each).
void paged_write(torch::Tensor arena, const torch::Tensor& key, const torch::Tensor& value,
                 const torch::Tensor& write_pages, const torch::Tensor& write_slots, at::IntArrayRef layout) {
  TORCH_CHECK(layout.size() == LAYOUT_LEN, "layout must have ", LAYOUT_LEN, " entries");
  TORCH_CHECK(arena.scalar_type() == torch::kUInt8 && arena.dim() == 2 && arena.is_contiguous(),
              "arena must be a contiguous (num_pages, page_bytes) uint8 tensor");
  TORCH_CHECK(key.dim() == 4 && value.dim() == 4 && key.size(0) == value.size(0) && key.size(2) == value.size(2),
              "key and value must be (B, H, n, width)");
  const int64_t page_bytes = layout[0], heads = layout[1], te = layout[5], k_off = layout[6], v_off = layout[7];
  const int64_t num_pages = arena.size(0);
  TORCH_CHECK(key.size(1) == heads && value.size(1) == heads && key.size(3) == layout[2] && value.size(3) == layout[3],
              "key and value do not have the layout's heads and widths");
  const int64_t B = key.size(0), n = key.size(2);
  auto pages = write_pages.contiguous(), slots = write_slots.contiguous();
  TORCH_CHECK(pages.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong &&
              pages.numel() == B * n && slots.numel() == B * n, "write_pages and write_slots must be (B * n,) int64");
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < B * n; ++t)
    TORCH_CHECK(pg[t] >= 0 && pg[t] < num_pages && sl[t] >= 0 && sl[t] < te, "a write slot is outside the pool");
  uint8_t* base = arena.data_ptr<uint8_t>();
  for (const auto& [x, off] : {std::pair<const torch::Tensor&, int64_t>{key, k_off}, {value, v_off}}) {
    auto src = x.stride(3) == 1 ? x : x.contiguous();
    const int64_t width = src.size(3), es = src.element_size(), row = width * es;
    const auto* data = static_cast<const uint8_t*>(src.data_ptr());
    const int64_t sb = src.stride(0) * es, sh = src.stride(1) * es, si = src.stride(2) * es;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = b * n + i;
        uint8_t* page = base + pg[t] * page_bytes + off;
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(page + (h * te + sl[t]) * row, data + b * sb + h * sh + i * si, row);
      }
  }
}

// The torch dtype of a layout's DType code (layout[4]).
c10::ScalarType kv_scalar(int64_t code) {
  return code == F32 ? torch::kFloat : code == BF16 ? torch::kBFloat16 : torch::kHalf;
}

// A post-hoc latent's write (mla on an MHA/GQA model) in one op: each new token's latent, ([RoPE_pos^-1(K_h) for
// each head h ; V_h for each head h] - mean) basis (Palu, arXiv 2407.21118; MHA2MLA, arXiv 2502.14837), RoPE undone
// at the token's own position (positions (B, n) int64; cos and sin (rows, d) fp32, a position past the last row
// taking the last), computed in fp32 and written into its exact slot (write_pages, write_slots (B * n,) int64) of
// the layer's one-stream layout (form 2) in the pool's dtype. key, value: (B, H, n, d); basis (2 H d, r); mean
// (2 H d,).
void paged_latent_write(torch::Tensor arena, const torch::Tensor& key, const torch::Tensor& value,
                        const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& basis, const torch::Tensor& mean, const torch::Tensor& write_pages,
                        const torch::Tensor& write_slots, at::IntArrayRef layout) {
  TORCH_CHECK(layout.size() == LAYOUT_LEN && layout[20] == 2 && layout[1] == 1,
              "layout must be a post-hoc latent's (form 2, one head)");
  TORCH_CHECK(arena.scalar_type() == torch::kUInt8 && arena.dim() == 2 && arena.is_contiguous() &&
                  arena.size(1) == layout[0], "arena must be a contiguous (num_pages, page_bytes) uint8 tensor");
  TORCH_CHECK(key.dim() == 4 && value.sizes() == key.sizes(), "key and value must be (B, H, n, d) alike");
  const int64_t B = key.size(0), H = key.size(1), n = key.size(2), d = key.size(3), half = d / 2, r = layout[2];
  const auto k = key.to(torch::kFloat).contiguous(), v = value.to(torch::kFloat).contiguous();
  const auto c = cos.to(torch::kFloat).contiguous(), sn = sin.to(torch::kFloat).contiguous();
  const auto pos = positions.contiguous();
  TORCH_CHECK(d % 2 == 0 && c.dim() == 2 && c.size(1) == d && sn.sizes() == c.sizes() && c.size(0) > 0,
              "cos and sin must be (rows, d), d even");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.dim() == 2 && pos.size(0) == B && pos.size(1) == n,
              "positions must be (B, n) int64");
  const auto P = basis.to(torch::kFloat).contiguous(), mu = mean.to(torch::kFloat).contiguous();
  TORCH_CHECK(P.dim() == 2 && P.size(0) == 2 * H * d && P.size(1) == r, "basis must be (2 H d, r): r the layout's");
  TORCH_CHECK(mu.dim() == 1 && mu.size(0) == 2 * H * d, "mean must be (2 H d,)");
  auto pages = write_pages.contiguous(), slots = write_slots.contiguous();
  TORCH_CHECK(pages.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong &&
              pages.numel() == B * n && slots.numel() == B * n, "write_pages and write_slots must be (B * n,) int64");
  const int64_t te = layout[5], num_pages = arena.size(0);
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < B * n; ++t)
    TORCH_CHECK(pg[t] >= 0 && pg[t] < num_pages && sl[t] >= 0 && sl[t] < te, "a write slot is outside the pool");
  auto x = torch::empty({B * n, 2 * H * d}, k.options());
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = c.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const float* mp = mu.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  const int64_t rows = c.size(0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      float* row = xp + (b * n + i) * 2 * H * d;
      const int64_t at = std::min<int64_t>(std::max<int64_t>(pp[b * n + i], 0), rows - 1);
      const float *cs = cp + at * d, *si = sp + at * d;
      for (int64_t h = 0; h < H; ++h) {
        const float* kk = kp + ((b * H + h) * n + i) * d;
        const float* vv = vp + ((b * H + h) * n + i) * d;
        float* ko = row + h * d;
        float* vo = row + (H + h) * d;
        for (int64_t j = 0; j < half; ++j) {  // rotated by the opposite angle, over its norm (RopeTable.invert_at)
          const float n1 = cs[j] * cs[j] + si[j] * si[j];
          const float n2 = cs[half + j] * cs[half + j] + si[half + j] * si[half + j];
          ko[j] = (kk[j] * cs[j] + kk[half + j] * si[j]) / n1 - mp[h * d + j];
          ko[half + j] = (kk[half + j] * cs[half + j] - kk[j] * si[half + j]) / n2 - mp[h * d + half + j];
        }
        for (int64_t j = 0; j < d; ++j) vo[j] = vv[j] - mp[(H + h) * d + j];
      }
    }
  const auto latent = at::matmul(x, P).to(kv_scalar(layout[4])).contiguous();  // (B n, r) in the pool's dtype
  const int64_t row_bytes = r * latent.element_size(), k_off = layout[6];
  const auto* src = static_cast<const uint8_t*>(latent.data_ptr());
  uint8_t* base = arena.data_ptr<uint8_t>();
  for (int64_t t = 0; t < B * n; ++t)
    std::memcpy(base + pg[t] * layout[0] + k_off + sl[t] * row_bytes, src + t * row_bytes, row_bytes);
}

// x W^T + bias through the AVX2 kernel for x of at most SKINNY_MAX_ROWS rows (after flattening its leading
// dimensions) in fp32, W contiguous fp32 (N x K); any other case through at::linear. Work split over blocks of
// SKINNY_BLOCK weight rows, each block read from memory once for every row of x.
constexpr int64_t SKINNY_BLOCK = 32;
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  const bool fits = use_avx2() && x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat &&
                    weight.dim() == 2 && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                    (!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->dim() == 1 &&
                                           bias->size(0) == weight.size(0)));
  if (!fits) return at::linear(x, weight, bias);
  const int64_t K = weight.size(1), N = weight.size(0);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  auto b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + SKINNY_BLOCK - 1) / SKINNY_BLOCK, 1, [&](int64_t begin, int64_t end) {
    skinny_linear_avx2(xp, wp, bp, yp, M, K, N, begin * SKINNY_BLOCK, std::min(N, end * SKINNY_BLOCK));
  });
  return y.view(out_sizes);
}

}  // namespace

std::string isa() { return use_avx2() ? "avx2" : "portable"; }

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_attention(Tensor query, Tensor arena, Tensor exact_table, Tensor q_table, Tensor ranges, "
        "int[] layout, Tensor? rotation, float scaling) -> Tensor");
  m.def("paged_latent_attention(Tensor query, Tensor arena, Tensor exact_table, Tensor q_table, Tensor ranges, "
        "int[] layout, Tensor key_up, Tensor key_mean, Tensor value_up, Tensor value_mean, Tensor positions, "
        "Tensor cos, Tensor sin, Tensor? rotated_bases, float scaling) -> Tensor");
  m.def("paged_dca_attention(Tensor query, Tensor src_arena, Tensor src_exact_table, Tensor src_q_table, "
        "Tensor src_ranges, int[] src_layout, Tensor src_positions, Tensor own_arena, Tensor own_exact_table, "
        "Tensor own_q_table, Tensor own_ranges, int[] own_layout, Tensor own_positions, int[] cuts, "
        "Tensor? rotation, Tensor[] map, Tensor[] latents, float scaling) -> Tensor");
  m.def("paged_write(Tensor(a!) arena, Tensor key, Tensor value, Tensor write_pages, Tensor write_slots, "
        "int[] layout) -> ()");
  m.def("paged_grouped_write(Tensor(a!) arena, Tensor key, Tensor value, Tensor key_encode, Tensor value_encode, "
        "Tensor write_pages, Tensor write_slots, int[] layout) -> ()");
  m.def("paged_mapped_attention(Tensor query, Tensor arena, Tensor exact_table, Tensor q_table, Tensor ranges, "
        "int[] layout, Tensor? rotation, Tensor query_map, Tensor output_map, float scaling) -> Tensor");
  m.def("paged_latent_write(Tensor(a!) arena, Tensor key, Tensor value, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor basis, Tensor mean, Tensor write_pages, Tensor write_slots, int[] layout) -> ()");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("kernel_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_latent_attention", &paged_latent_attention);
  m.impl("paged_dca_attention", &paged_dca_attention);
  m.impl("paged_write", &paged_write);
  m.impl("paged_grouped_write", &paged_grouped_write);
  m.impl("paged_mapped_attention", &paged_mapped_attention);
  m.impl("paged_latent_write", &paged_latent_write);
  m.impl("skinny_linear", &skinny_linear);
}

}  // namespace kvserve
