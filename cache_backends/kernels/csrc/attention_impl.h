// Paged attention over the KV pool in place: the body compiled once per instruction set. Included inside a
// namespace by attention_avx2.cpp (KVK_AVX2 defined, under `#pragma GCC target("avx2,fma,f16c")`) and by
// attention_portable.cpp; it includes nothing itself (the including file brings <cmath>, <cstring>, <vector>,
// <algorithm>, <limits> and, for AVX2, <immintrin.h> and <type_traits>).
//
// One work item is (row b, KV head h, a tile of query tokens): the tile's query heads of KV head h (GQA: the
// rep = Hq / H heads that share it) are scored together against the row's tokens, read straight from its pages
// through the block tables, in blocks of at most BN tokens (across pages): the quantized tier first (keys per
// channel over groups of `group` tokens, values per token; 8-bit codes or two 4-bit codes a byte), then the
// exact tier. A native-MLA latent (a.latent) is one head read by every query head: its key is (c_t, k_rope_t),
// its value c_t, both streams per channel over groups when quantized. A chunk's keys and values are used in place
// when they are fp32 exact tokens, else widened into an fp32 scratch of BN tokens; the softmax is computed online
// (FlashAttention, arXiv 2205.14135), so nothing the size of the context is allocated. Each query token sees the
// quantized tokens [q0, q) and the exact tokens [lo, hi) of its `ranges` entry (q, lo, hi[, q0]; q0 is 0 when
// absent, a sliding window's start otherwise): the step's mask (cache_backends/step_meta.py) as intervals. A
// 6-column entry (q, lo, hi, q0, s0, s1) adds the attention sinks (StreamingLLM, arXiv 2309.17453): slots [s0, s1)
// of the sink tier (the quantized tier when the layout has one, else the exact tier), disjoint from the others,
// attended first by split 0 of the item.

constexpr int64_t BN = 64;  // tokens per block (across pages)
#ifndef KVK_LATENT_BN
#define KVK_LATENT_BN 16  // tokens per block of a native-MLA latent (at most BN)
#endif
#ifndef KVK_SCRATCH_BN
#define KVK_SCRATCH_BN 32  // tokens per block whose keys are built in the scratch (at most BN: they stay in L1): a
                           // post-hoc latent's, rebuilt; a dca source's, every head's assembled
#endif

// ---------------------------------------------------------------------------------------------- scalars
inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float load_one(const uint8_t* p, int dtype, int64_t i) {
  switch (dtype) {
    case F32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
    case BF16: { uint16_t x; std::memcpy(&x, p + 2 * i, 2); return bf16_to_f32(x); }
    default: { uint16_t x; std::memcpy(&x, p + 2 * i, 2); return f16_to_f32(x); }
  }
}

// ---------------------------------------------------------------------------------------------- vectors
#ifdef KVK_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8 horizontal sums of a0..a7, in order, as one vector.
inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// e^x for x <= 0 (the softmax's shifted scores), 0 below -87; relative error about 2e-7 (Cephes' polynomial).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

inline __m256 load8(const uint8_t* p, int dtype) {  // 8 elements of an exact tier or scale row → fp32
  switch (dtype) {
    case F32: return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    case BF16: return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    default: return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}
#endif

inline float dot(const float* a, const float* b, int64_t d) {
  int64_t c = 0;
  float s = 0.f;
#ifdef KVK_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; c + 8 <= d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  s = hsum8(acc);
#endif
  for (; c < d; ++c) s += a[c] * b[c];
  return s;
}

// s0[j] = q0 · k_j (and s1[j] = q1 · k_j when q1 is given) for the keys j in [j0, j1), key j at kp[j].
inline void scores(const float* q0, const float* q1, const float* const* kp, int64_t j0, int64_t j1, int64_t d,
                   float* s0, float* s1) {
  int64_t j = j0;
#ifdef KVK_AVX2
  if (d % 8 == 0) {
    if (q1 != nullptr) {  // two rows: each key's loads serve both
      for (; j + 4 <= j1; j += 4) {
        const float *k0 = kp[j], *k1 = kp[j + 1], *k2 = kp[j + 2], *k3 = kp[j + 3];
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 x = _mm256_loadu_ps(q0 + c), y = _mm256_loadu_ps(q1 + c);
          __m256 k = _mm256_loadu_ps(k0 + c);
          a0 = _mm256_fmadd_ps(x, k, a0);
          b0 = _mm256_fmadd_ps(y, k, b0);
          k = _mm256_loadu_ps(k1 + c);
          a1 = _mm256_fmadd_ps(x, k, a1);
          b1 = _mm256_fmadd_ps(y, k, b1);
          k = _mm256_loadu_ps(k2 + c);
          a2 = _mm256_fmadd_ps(x, k, a2);
          b2 = _mm256_fmadd_ps(y, k, b2);
          k = _mm256_loadu_ps(k3 + c);
          a3 = _mm256_fmadd_ps(x, k, a3);
          b3 = _mm256_fmadd_ps(y, k, b3);
        }
        const __m256 r = hsum8x8(a0, a1, a2, a3, b0, b1, b2, b3);
        _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(r));
        _mm_storeu_ps(s1 + j, _mm256_extractf128_ps(r, 1));
      }
    } else {
      for (; j + 8 <= j1; j += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 x = _mm256_loadu_ps(q0 + c);
          a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j] + c), a0);
          a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 1] + c), a1);
          a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 2] + c), a2);
          a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 3] + c), a3);
          a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 4] + c), a4);
          a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 5] + c), a5);
          a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 6] + c), a6);
          a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + 7] + c), a7);
        }
        _mm256_storeu_ps(s0 + j, hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7));
      }
    }
  }
#endif
  for (; j < j1; ++j) {
    s0[j] = dot(q0, kp[j], d);
    if (q1 != nullptr) s1[j] = dot(q1, kp[j], d);
  }
}

// acc0[c] = acc0[c] * alpha0 + Σ_j p0[j] v_j[c] over j in [j0, j1), value j at vp[j]; the same for a second row
// (acc1, p1, alpha1) when acc1 is given, each value's loads serving both.
inline void weighted_values(float* acc0, float alpha0, const float* p0, float* acc1, float alpha1, const float* p1,
                            const float* const* vp, int64_t j0, int64_t j1, int64_t dv) {
  int64_t c = 0;
#ifdef KVK_AVX2
  const __m256 al0 = _mm256_set1_ps(alpha0), al1 = _mm256_set1_ps(alpha1);
  if (acc1 != nullptr) {
    for (; c + 32 <= dv; c += 32) {
      __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c), al0), o1 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 8), al0);
      __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 16), al0);
      __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 24), al0);
      __m256 u0 = _mm256_mul_ps(_mm256_loadu_ps(acc1 + c), al1), u1 = _mm256_mul_ps(_mm256_loadu_ps(acc1 + c + 8), al1);
      __m256 u2 = _mm256_mul_ps(_mm256_loadu_ps(acc1 + c + 16), al1);
      __m256 u3 = _mm256_mul_ps(_mm256_loadu_ps(acc1 + c + 24), al1);
      for (int64_t j = j0; j < j1; ++j) {
        const float* v = vp[j] + c;
        const __m256 x = _mm256_set1_ps(p0[j]), y = _mm256_set1_ps(p1[j]);
        __m256 t = _mm256_loadu_ps(v);
        o0 = _mm256_fmadd_ps(x, t, o0);
        u0 = _mm256_fmadd_ps(y, t, u0);
        t = _mm256_loadu_ps(v + 8);
        o1 = _mm256_fmadd_ps(x, t, o1);
        u1 = _mm256_fmadd_ps(y, t, u1);
        t = _mm256_loadu_ps(v + 16);
        o2 = _mm256_fmadd_ps(x, t, o2);
        u2 = _mm256_fmadd_ps(y, t, u2);
        t = _mm256_loadu_ps(v + 24);
        o3 = _mm256_fmadd_ps(x, t, o3);
        u3 = _mm256_fmadd_ps(y, t, u3);
      }
      _mm256_storeu_ps(acc0 + c, o0);
      _mm256_storeu_ps(acc0 + c + 8, o1);
      _mm256_storeu_ps(acc0 + c + 16, o2);
      _mm256_storeu_ps(acc0 + c + 24, o3);
      _mm256_storeu_ps(acc1 + c, u0);
      _mm256_storeu_ps(acc1 + c + 8, u1);
      _mm256_storeu_ps(acc1 + c + 16, u2);
      _mm256_storeu_ps(acc1 + c + 24, u3);
    }
  } else {
    for (; c + 32 <= dv; c += 32) {
      __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c), al0), o1 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 8), al0);
      __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 16), al0);
      __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 24), al0);
      for (int64_t j = j0; j < j1; ++j) {
        const float* v = vp[j] + c;
        const __m256 x = _mm256_set1_ps(p0[j]);
        o0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v), o0);
        o1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 8), o1);
        o2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 16), o2);
        o3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 24), o3);
      }
      _mm256_storeu_ps(acc0 + c, o0);
      _mm256_storeu_ps(acc0 + c + 8, o1);
      _mm256_storeu_ps(acc0 + c + 16, o2);
      _mm256_storeu_ps(acc0 + c + 24, o3);
    }
  }
  for (; c + 8 <= dv; c += 8) {  // widths not a multiple of 32 (a post-hoc latent's rank): eight channels at a time
    __m256 o = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c), al0);
    __m256 u = acc1 != nullptr ? _mm256_mul_ps(_mm256_loadu_ps(acc1 + c), al1) : _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; ++j) {
      const __m256 t = _mm256_loadu_ps(vp[j] + c);
      o = _mm256_fmadd_ps(_mm256_set1_ps(p0[j]), t, o);
      if (acc1 != nullptr) u = _mm256_fmadd_ps(_mm256_set1_ps(p1[j]), t, u);
    }
    _mm256_storeu_ps(acc0 + c, o);
    if (acc1 != nullptr) _mm256_storeu_ps(acc1 + c, u);
  }
#endif
  for (; c < dv; ++c) {
    float o = acc0[c] * alpha0;
    for (int64_t j = j0; j < j1; ++j) o += p0[j] * vp[j][c];
    acc0[c] = o;
    if (acc1 != nullptr) {
      float u = acc1[c] * alpha1;
      for (int64_t j = j0; j < j1; ++j) u += p1[j] * vp[j][c];
      acc1[c] = u;
    }
  }
}

// The largest of s[j0..j1) (j1 > j0).
inline float max_of(const float* s, int64_t j0, int64_t j1) {
  int64_t j = j0;
  float mx = -std::numeric_limits<float>::infinity();
#ifdef KVK_AVX2
  if (j + 8 <= j1) {
    __m256 m = _mm256_loadu_ps(s + j);
    for (j += 8; j + 8 <= j1; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = _mm_cvtss_f32(h);
  }
#endif
  for (; j < j1; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// p[j] = exp(s[j] - m) for j in [j0, j1); returns their sum.
inline float exp_row(const float* s, float m, int64_t j0, int64_t j1, float* p) {
  int64_t j = j0;
  float sum = 0.f;
#ifdef KVK_AVX2
  __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
  for (; j + 8 <= j1; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; j < j1; ++j) {
    p[j] = std::exp(s[j] - m);
    sum += p[j];
  }
  return sum;
}

// Σ_j p[j] z[j] over [j0, j1), returned, and p[j] *= s[j]: a row's softmax weights given each token's value scale
// s and zero point z (its zero points' sum kept apart), eight tokens at a time.
inline float fold_value_scales(float* p, const float* s, const float* z, int64_t j0, int64_t j1) {
  int64_t j = j0;
  float sum = 0.f;
#ifdef KVK_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= j1; j += 8) {
    const __m256 pv = _mm256_loadu_ps(p + j);
    acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(z + j), acc);
    _mm256_storeu_ps(p + j, _mm256_mul_ps(pv, _mm256_loadu_ps(s + j)));
  }
  sum = hsum8(acc);
#endif
  for (; j < j1; ++j) {
    sum += p[j] * z[j];
    p[j] *= s[j];
  }
  return sum;
}

// ---------------------------------------------------------------------------------------------- widening
// One token of an exact tier (width elements of `dtype`) → fp32.
inline void widen_exact(const uint8_t* src, int dtype, int64_t width, float* dst) {
  int64_t c = 0;
#ifdef KVK_AVX2
  const int64_t es = dtype == F32 ? 4 : 2;
  for (; c + 8 <= width; c += 8) _mm256_storeu_ps(dst + c, load8(src + c * es, dtype));
#endif
  for (; c < width; ++c) dst[c] = load_one(src, dtype, c);
}

// One token of a per-channel stream (a key): code[c] * scale[c] + zero[c]. 8-bit codes are int8; 4-bit codes
// are nibbles, channel c < width/2 in the low nibble of byte c, channel c + width/2 in its high nibble.
inline void widen_channel(const uint8_t* codes, int bits, const uint8_t* scale, const uint8_t* zero, int sdtype,
                          int64_t width, float* dst) {
  const int64_t es = sdtype == F32 ? 4 : 2;
  if (bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(codes);
    int64_t c = 0;
#ifdef KVK_AVX2
    for (; c + 8 <= width; c += 8) {
      __m256 cv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c))));
      _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(cv, load8(scale + c * es, sdtype), load8(zero + c * es, sdtype)));
    }
#endif
    for (; c < width; ++c) dst[c] = q[c] * load_one(scale, sdtype, c) + load_one(zero, sdtype, c);
    return;
  }
  const int64_t half = width / 2;
  int64_t c = 0;
#ifdef KVK_AVX2
  const __m256i low = _mm256_set1_epi32(15);
  for (; c + 8 <= half; c += 8) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c)));
    __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(lo, load8(scale + c * es, sdtype), load8(zero + c * es, sdtype)));
    _mm256_storeu_ps(dst + half + c, _mm256_fmadd_ps(hi, load8(scale + (half + c) * es, sdtype),
                                                     load8(zero + (half + c) * es, sdtype)));
  }
#endif
  for (; c < half; ++c) {
    dst[c] = (codes[c] & 15) * load_one(scale, sdtype, c) + load_one(zero, sdtype, c);
    dst[half + c] = (codes[c] >> 4) * load_one(scale, sdtype, half + c) + load_one(zero, sdtype, half + c);
  }
}

// One token of a per-token stream (a value): code[c] * s + z.
inline void widen_token(const uint8_t* codes, int bits, float s, float z, int64_t width, float* dst) {
  if (bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(codes);
    int64_t c = 0;
#ifdef KVK_AVX2
    const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
    for (; c + 8 <= width; c += 8) {
      __m256 cv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c))));
      _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(cv, sv, zv));
    }
#endif
    for (; c < width; ++c) dst[c] = q[c] * s + z;
    return;
  }
  const int64_t half = width / 2;
  int64_t c = 0;
#ifdef KVK_AVX2
  const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
  const __m256i low = _mm256_set1_epi32(15);
  for (; c + 8 <= half; c += 8) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c)));
    _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), sv, zv));
    _mm256_storeu_ps(dst + half + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sv, zv));
  }
#endif
  for (; c < half; ++c) {
    dst[c] = (codes[c] & 15) * s + z;
    dst[half + c] = (codes[c] >> 4) * s + z;
  }
}

// ---------------------------------------------------------------------------------------------- post-hoc latent
// out_j = c_j P + mu for the nj tokens of a block (c_j at cp[j], r wide; P (r x d) row-major, mu (d)), written to
// out + j * d: a post-hoc latent's (mla on an MHA/GQA model; Palu, arXiv 2407.21118; MHA2MLA, arXiv 2502.14837)
// keys or values of one KV head, rebuilt for one block only: nothing the size of the context is written, and the
// latent is read where it lies (fp32) or from the block's widened copy. AVX2: four tokens by sixteen channels at a
// time in registers (d a multiple of 16).
inline void project(const float* P, const float* mu, int64_t r, int64_t d, const float* const* cp, int64_t nj,
                    float* out) {
  int64_t j = 0;
#ifdef KVK_AVX2
  if (d % 16 == 0) {
    for (; j + 4 <= nj; j += 4) {
      const float *c0 = cp[j], *c1 = cp[j + 1], *c2 = cp[j + 2], *c3 = cp[j + 3];
      for (int64_t i = 0; i < d; i += 16) {
        const __m256 m0 = _mm256_loadu_ps(mu + i), m1 = _mm256_loadu_ps(mu + i + 8);
        __m256 o00 = m0, o01 = m1, o10 = m0, o11 = m1, o20 = m0, o21 = m1, o30 = m0, o31 = m1;
        for (int64_t c = 0; c < r; ++c) {
          const __m256 p0 = _mm256_loadu_ps(P + c * d + i), p1 = _mm256_loadu_ps(P + c * d + i + 8);
          __m256 x = _mm256_broadcast_ss(c0 + c);
          o00 = _mm256_fmadd_ps(x, p0, o00);
          o01 = _mm256_fmadd_ps(x, p1, o01);
          x = _mm256_broadcast_ss(c1 + c);
          o10 = _mm256_fmadd_ps(x, p0, o10);
          o11 = _mm256_fmadd_ps(x, p1, o11);
          x = _mm256_broadcast_ss(c2 + c);
          o20 = _mm256_fmadd_ps(x, p0, o20);
          o21 = _mm256_fmadd_ps(x, p1, o21);
          x = _mm256_broadcast_ss(c3 + c);
          o30 = _mm256_fmadd_ps(x, p0, o30);
          o31 = _mm256_fmadd_ps(x, p1, o31);
        }
        float* oj = out + j * d + i;
        _mm256_storeu_ps(oj, o00);
        _mm256_storeu_ps(oj + 8, o01);
        _mm256_storeu_ps(oj + d, o10);
        _mm256_storeu_ps(oj + d + 8, o11);
        _mm256_storeu_ps(oj + 2 * d, o20);
        _mm256_storeu_ps(oj + 2 * d + 8, o21);
        _mm256_storeu_ps(oj + 3 * d, o30);
        _mm256_storeu_ps(oj + 3 * d + 8, o31);
      }
    }
  }
#endif
  for (; j < nj; ++j) {  // the tokens left (and every token on the portable path)
    float* oj = out + j * d;
    std::copy(mu, mu + d, oj);
    const float* cj = cp[j];
    for (int64_t c = 0; c < r; ++c) {
      const float x = cj[c];
      const float* pc = P + c * d;
      for (int64_t i = 0; i < d; ++i) oj[i] += x * pc[i];
    }
  }
}

// The keys of KV head h for a block of a post-hoc latent: k_j = RoPE_pos[j](c_j P_h + mu_h), RoPE in transformers'
// Llama layout (channel i pairs with i + d/2) at each token's own position.
inline void rebuild_keys(const PagedArgs& a, int64_t h, const float* const* cp, int64_t nj, const int64_t* pos,
                         float* k, const float* key_up) {
  const int64_t r = a.kw, d = a.hd, half = d / 2;
  project(key_up + h * r * d, a.key_mean + h * d, r, d, cp, nj, k);
  for (int64_t j = 0; j < nj; ++j) {
    const int64_t row = std::min<int64_t>(std::max<int64_t>(pos[j], 0), a.rope_rows - 1);
    const float *cs = a.cos + row * d, *sn = a.sin + row * d;
    float* kj = k + j * d;
    int64_t i = 0;
#ifdef KVK_AVX2
    for (; i + 8 <= half && half % 8 == 0; i += 8) {
      const __m256 x1 = _mm256_loadu_ps(kj + i), x2 = _mm256_loadu_ps(kj + half + i);
      _mm256_storeu_ps(kj + i,
                       _mm256_fmsub_ps(x1, _mm256_loadu_ps(cs + i), _mm256_mul_ps(x2, _mm256_loadu_ps(sn + i))));
      _mm256_storeu_ps(kj + half + i, _mm256_fmadd_ps(x2, _mm256_loadu_ps(cs + half + i),
                                                      _mm256_mul_ps(x1, _mm256_loadu_ps(sn + half + i))));
    }
#endif
    for (; i < half; ++i) {
      const float x1 = kj[i], x2 = kj[half + i];
      kj[i] = x1 * cs[i] - x2 * sn[i];
      kj[half + i] = x2 * cs[half + i] + x1 * sn[half + i];
    }
  }
}

// A block of a post-hoc latent made ready for attend_block: keys rebuilt into w.k (kp), and with rebuild_values the
// values into w.vr (vp, which held the latent's tokens); else vp stays at the latent (summed, projected at the end).
template <class S>
inline void posthoc_block(const PagedArgs& a, int64_t h, int64_t nj, S& w, const float** kp, const float** vp,
                          bool rotated_tier) {
  rebuild_keys(a, h, vp, nj, w.pos.data(), w.k.data(), rotated_tier ? a.key_up_rot : a.key_up);
  for (int64_t j = 0; j < nj; ++j) kp[j] = w.k.data() + j * a.d;
  if (!a.rebuild_values) return;
  const int64_t r = a.kw, d = a.hd;
  project((rotated_tier ? a.value_up_rot : a.value_up) + h * r * d, a.value_mean + h * d, r, d, vp, nj,
          w.vr.data());
  for (int64_t j = 0; j < nj; ++j) vp[j] = w.vr.data() + j * d;
}

// A block of a dca source held as a post-hoc latent (dca+mla) made ready for attend_block: every KV head g's keys
// rebuilt, RoPE_pos(c_t P_g + mu_g), side by side in w.k ([K_0,t ; ... ; K_H-1,t], H hd wide); the values stay the
// latent (summed, then each head's projected once a row: finalize).
template <class S>
inline void mixed_latent_block(const PagedArgs& a, int64_t nj, S& w, const float** kp, const float* const* vp,
                               bool rotated_tier) {
  const int64_t hd = a.hd, dk = a.H * hd;
  for (int64_t g = 0; g < a.H; ++g) {
    rebuild_keys(a, g, vp, nj, w.pos.data(), w.kg.data(), rotated_tier ? a.key_up_rot : a.key_up);
    for (int64_t j = 0; j < nj; ++j)
      std::copy(w.kg.data() + j * hd, w.kg.data() + (j + 1) * hd, w.k.data() + j * dk + g * hd);
  }
  for (int64_t j = 0; j < nj; ++j) kp[j] = w.k.data() + j * dk;
}

// ---------------------------------------------------------------------------------------------- dca's mixed source
// Token t's key of a dca reuse layer's source, assembled at k (H kw wide): each source head's key, widened from its
// tier; its value at v (H kw wide): each source head's value. `base`: the token's exact page (form 0) or quantized
// page, slot u. Every query head's rows read the same block (the map's key bias, which differs by KV head, is scored
// apart: mixed_bias_scores).
inline void rope_row(const PagedArgs& a, const float* x, int64_t pos, int64_t w, float* out) {
  const int64_t row = std::min<int64_t>(std::max<int64_t>(pos, 0), a.rope_rows - 1), half = w / 2;
  const float *cs = a.cos + row * w, *sn = a.sin + row * w;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cs[i] - x[half + i] * sn[i];
    out[half + i] = x[half + i] * cs[half + i] + x[i] * sn[half + i];
  }
}

inline void mixed_exact(const PagedArgs& a, const uint8_t* base, int64_t u, float* k, float* v) {
  const int64_t es = a.kv_dtype == F32 ? 4 : 2, w = a.kw;
  for (int64_t g = 0; g < a.H; ++g) {
    widen_exact(base + a.k_off + (g * a.te + u) * w * es, a.kv_dtype, w, k + g * w);
    widen_exact(base + a.v_off + (g * a.te + u) * w * es, a.kv_dtype, w, v + g * w);
  }
}

inline void mixed_quant(const PagedArgs& a, const uint8_t* base, int64_t u, float* k, float* v) {
  const int64_t w = a.kw, kcw = w * a.k_bits / 8, vcw = w * a.v_bits / 8, groups = a.tq / a.group;
  const int64_t kse = a.ks_dtype == F32 ? 4 : 2;
  for (int64_t g = 0; g < a.H; ++g) {
    const int64_t slot = g * a.tq + u, grp = g * groups + u / a.group;
    widen_channel(base + a.kc_off + slot * kcw, a.k_bits, base + a.ks_off + grp * w * kse,
                  base + a.kz_off + grp * w * kse, a.ks_dtype, w, k + g * w);
    widen_token(base + a.vc_off + slot * vcw, a.v_bits, load_one(base + a.vs_off, a.vs_dtype, slot),
                load_one(base + a.vz_off, a.vs_dtype, slot), w, v + g * w);
  }
}

// A dca source block's key-bias scores into w.bs (rows x BN): row r (query head r % Hq, of KV head (r % Hq) / (Hq /
// H)) and token j, q_r · RoPE_pos[j](b_h), the query part of the row (w.qb, scaled) against the map's key bias
// rotated to the token's position (w.pos), once per block and KV head.
template <class S>
inline void mixed_bias_scores(const PagedArgs& a, int64_t M, int64_t nj, S& w) {
  const int64_t kw = a.hd, rep = a.Hq / a.H;
  for (int64_t g = 0; g < a.H; ++g)
    for (int64_t j = 0; j < nj; ++j) rope_row(a, a.key_bias + g * kw, w.pos[j], kw, w.rb.data() + (g * BN + j) * kw);
  for (int64_t r = 0; r < M; ++r) {
    const float* qb = w.qb.data() + r * kw;
    const float* rb = w.rb.data() + ((r % a.Hq) / rep) * BN * kw;
    for (int64_t j = 0; j < nj; ++j) w.bs[r * BN + j] = dot(qb, rb + j * kw, kw);
  }
}

// ---------------------------------------------------------------------------------------------- quantized, fused
#ifdef KVK_AVX2
// The quantized tier attended straight from its codes (AVX2, head_dim a multiple of 16): a key group's scales fold
// into the query (q·(code*s + z) = (q*s)·code + q·z), a token's value scale into its softmax weight and its zero
// point into one sum per row, so each code is converted once in registers and used by every query row at once; no
// widened copy is written. The same sums as the widening path, in another order (fp32 throughout), but for 4-bit
// keys' scores, summed in integers (q_scores_i8) unless the call asks for fp32 sums (PagedArgs::int_sums).

inline __m256 cvt8_i8(const uint8_t* p) {  // 8 int8 codes → fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void cvt8_u4(const uint8_t* p, __m256& lo, __m256& hi) {  // 8 bytes of nibbles → low and high nibbles, fp32
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

inline float code_at(const uint8_t* codes, int bits, int64_t width, int64_t c) {  // channel c of one token's codes
  if (bits == 8) return static_cast<float>(reinterpret_cast<const int8_t*>(codes)[c]);
  const int64_t half = width / 2;
  return static_cast<float>(c < half ? (codes[c] & 15) : (codes[c - half] >> 4));
}

// s[r * BN + j] = qg_r · code_j + bias_r for the R rows of qg (R x d, the group's scales folded in) and the tokens j
// in [ja, jb) of one key group, token j's key codes at kc[j]. Two tokens at a time, R x 2 sums in one hsum8x8.
template <int R>
inline void q_scores(const float* qg, const float* bias, int64_t d, int bits, const uint8_t* const* kc, int64_t ja,
                     int64_t jb, float* s) {
  int64_t j = ja;
  for (; j + 2 <= jb; j += 2) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    const uint8_t *c0 = kc[j], *c1 = kc[j + 1];
    if (bits == 8) {
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 x0 = cvt8_i8(c0 + c), x1 = cvt8_i8(c1 + c);
        for (int r = 0; r < R; ++r) {
          const __m256 qv = _mm256_loadu_ps(qg + r * d + c);
          acc[r] = _mm256_fmadd_ps(qv, x0, acc[r]);
          acc[4 + r] = _mm256_fmadd_ps(qv, x1, acc[4 + r]);
        }
      }
    } else {
      const int64_t half = d / 2;
      for (int64_t c = 0; c < half; c += 8) {
        __m256 l0, h0, l1, h1;
        cvt8_u4(c0 + c, l0, h0);
        cvt8_u4(c1 + c, l1, h1);
        for (int r = 0; r < R; ++r) {
          const __m256 ql = _mm256_loadu_ps(qg + r * d + c), qh = _mm256_loadu_ps(qg + r * d + half + c);
          acc[r] = _mm256_fmadd_ps(qh, h0, _mm256_fmadd_ps(ql, l0, acc[r]));
          acc[4 + r] = _mm256_fmadd_ps(qh, h1, _mm256_fmadd_ps(ql, l1, acc[4 + r]));
        }
      }
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, hsum8x8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
    for (int r = 0; r < R; ++r) {
      s[r * BN + j] = out[r] + bias[r];
      s[r * BN + j + 1] = out[4 + r] + bias[r];
    }
  }
  for (; j < jb; ++j)
    for (int r = 0; r < R; ++r) {
      float sum = bias[r];
      for (int64_t c = 0; c < d; ++c) sum += qg[r * d + c] * code_at(kc[j], bits, d, c);
      s[r * BN + j] = sum;
    }
}

// 4-bit keys scored with 8-bit integer dot products, as llama.cpp's CPU flash attention scores its quantized keys
// (ggml-cpu: the query quantized once per row): a row's query, its key group's scales folded in (qg), is rounded
// once per group to int8 codes q8 = round(qg * 127 / max|qg|) with one scale sig = max|qg| / 127, laid out as the
// key codes are (for each 16 code bytes: the 16 channels of their low nibbles, then the 16 of their high nibbles),
// and s = sig * Σ q8 · code + bias, the sum exact in integers (maddubs: pairs of 15 x 127 at most, at most 8 per
// int16 lane for head_dim <= 256). The query's rounding adds to a score an error of about a sixth (RMS) of what the
// 4-bit keys' own rounding puts there; 8-bit keys, whose rounding is 17x finer, keep the fp32 sums of q_scores.
inline bool int8_dot(int bits, int64_t d) { return bits == 4 && d % 32 == 0 && d <= 256; }

// q8 (d int8, the codes' layout) and sig from one row's qg (d floats).
inline void quantize_query_i8(const float* qg, int64_t d, int8_t* q8, float* sig) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 v = _mm256_loadu_ps(qg + c);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  if (!(m > 0.f) || std::isinf(m) || _mm256_movemask_ps(nan) != 0) {
    // a zero query row (or a group of zero scales): every score is its bias; a NaN or infinite one: every score
    // NaN, as the fp32 sums give
    std::memset(q8, 0, d);
    *sig = m > 0.f || _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN() : 0.f;
    return;
  }
  *sig = m / 127.f;
  const __m256 inv = _mm256_set1_ps(127.f / m);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t half = d / 2;
  for (int64_t c = 0; c < half; c += 16) {  // 32 codes: channels c..c+15, then half+c..half+c+15
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qg + c), inv));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qg + c + 8), inv));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qg + half + c), inv));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qg + half + c + 8), inv));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8 + 2 * c), _mm256_permutevar8x32_epi32(packed, order));
  }
}

// s[r * BN + j] = sig_r * (q8_r · code_j) + bias_r for R rows and the tokens j in [ja, jb) of one key group (4-bit
// codes, token j's at kc[j]), two tokens at a time.
template <int R>
inline void q_scores_i8(const int8_t* q8, const float* sig, const float* bias, int64_t d, const uint8_t* const* kc,
                        int64_t ja, int64_t jb, float* s) {
  const int64_t half = d / 2;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  auto nibbles = [&](const uint8_t* p) {  // 16 code bytes → their 16 low nibbles, then their 16 high ones
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(x), _mm_srli_epi16(x, 4), 1), low);
  };
  int64_t j = ja;
  for (; j + 2 <= jb; j += 2) {
    __m256i acc[2 * R];
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t c = 0; c < half; c += 16) {
      const __m256i x0 = nibbles(kc[j] + c), x1 = nibbles(kc[j + 1] + c);
      for (int r = 0; r < R; ++r) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + r * d + 2 * c));
        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(x0, qv));
        acc[R + r] = _mm256_add_epi16(acc[R + r], _mm256_maddubs_epi16(x1, qv));
      }
    }
    __m256 f[8];
    for (int i = 0; i < 8; ++i) f[i] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      f[r] = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones));
      f[4 + r] = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[R + r], ones));
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, hsum8x8(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]));
    for (int r = 0; r < R; ++r) {
      s[r * BN + j] = out[r] * sig[r] + bias[r];
      s[r * BN + j + 1] = out[4 + r] * sig[r] + bias[r];
    }
  }
  for (; j < jb; ++j)
    for (int r = 0; r < R; ++r) {
      int32_t sum = 0;
      for (int64_t c = 0; c < half; ++c) {
        const int64_t at = r * d + 2 * (c & ~int64_t{15}) + (c & 15);
        sum += q8[at] * (kc[j][c] & 15) + q8[at + 16] * (kc[j][c] >> 4);
      }
      s[r * BN + j] = static_cast<float>(sum) * sig[r] + bias[r];
    }
}

// acc_r += zs_r + Σ_j p[r * BN + j] code_j (every channel) for R rows, token j's value codes at vc[j], j < nj.
template <int R>
inline void q_values(const float* p, const float* zs, float* acc, int64_t dv, int bits, const uint8_t* const* vc,
                     int64_t nj) {
  const int64_t half = dv / 2;
  const int64_t step = bits == 8 ? 16 : 8, end = bits == 8 ? dv : half;
  for (int64_t c = 0; c < end; c += step) {
    const int64_t c2 = bits == 8 ? c + 8 : half + c;  // the unit's second 8 channels
    __m256 o[8];
    for (int r = 0; r < R; ++r) {
      const __m256 z = _mm256_set1_ps(zs[r]);
      o[2 * r] = _mm256_add_ps(_mm256_loadu_ps(acc + r * dv + c), z);
      o[2 * r + 1] = _mm256_add_ps(_mm256_loadu_ps(acc + r * dv + c2), z);
    }
    for (int64_t j = 0; j < nj; ++j) {
      __m256 x0, x1;
      if (bits == 8) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vc[j] + c));
        x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
      } else {
        cvt8_u4(vc[j] + c, x0, x1);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_broadcast_ss(p + r * BN + j);
        o[2 * r] = _mm256_fmadd_ps(wv, x0, o[2 * r]);
        o[2 * r + 1] = _mm256_fmadd_ps(wv, x1, o[2 * r + 1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * dv + c, o[2 * r]);
      _mm256_storeu_ps(acc + r * dv + c2, o[2 * r + 1]);
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------- the work item
struct Scratch {
  std::vector<float> q, qr, acc_q, acc_e, m, l, s, p, k, v, vr, qg, bias, vs, vz, zs, sig, qb, rb, bs, kg, kt, al;
  std::vector<int8_t> q8;
  std::vector<int64_t> pos;
  std::vector<const float*> kp, vp;
  std::vector<const uint8_t*> kc, vc;
};

#ifdef KVK_AVX2
// A prefill tile's rows against a block as two small matrix products (the register blocking of a GEMM micro-kernel,
// as llama.cpp's and onnxruntime's CPU attention multiply a tile of queries by a block of keys): R rows x 16 tokens
// of scores, or R rows x 16 channels of weighted values, held in 2R registers while the loop over the shared
// dimension broadcasts one row's element and loads 16 of the other matrix's. No horizontal sum, and each load
// serves R rows where the pairwise path's serves two.
constexpr int64_t GEMM_MIN_ROWS = 12;  // a tile of fewer rows (a decode's query heads) takes the pairwise path
constexpr int GEMM_ROWS = 6;           // rows a register block holds: 12 accumulators, 2 loads, 1 broadcast

template <int R>
inline void gemm_scores(const float* q, int64_t d, const float* kt, int64_t njp, float* s) {
  for (int64_t j = 0; j < njp; j += 16) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m256 k0 = _mm256_loadu_ps(kt + c * BN + j), k1 = _mm256_loadu_ps(kt + c * BN + j + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(q + r * d + c);
        a0[r] = _mm256_fmadd_ps(x, k0, a0[r]);
        a1[r] = _mm256_fmadd_ps(x, k1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * BN + j, a0[r]);
      _mm256_storeu_ps(s + r * BN + j + 8, a1[r]);
    }
  }
}

template <int R>
inline void gemm_values(const float* p, const float* const* vp, int64_t ja, int64_t jb, const float* alpha,
                        float* acc, int64_t dv) {
  for (int64_t c = 0; c < dv; c += 16) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      const __m256 al = _mm256_broadcast_ss(alpha + r);
      a0[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * dv + c), al);
      a1[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * dv + c + 8), al);
    }
    for (int64_t j = ja; j < jb; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vp[j] + c), v1 = _mm256_loadu_ps(vp[j] + c + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(p + r * BN + j);
        a0[r] = _mm256_fmadd_ps(x, v0, a0[r]);
        a1[r] = _mm256_fmadd_ps(x, v1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * dv + c, a0[r]);
      _mm256_storeu_ps(acc + r * dv + c + 8, a1[r]);
    }
  }
}

// f(R) with R (1..GEMM_ROWS) a compile-time row count: the templates' instance for a register block's rows.
template <class F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// attend_block for a tile of many rows (d a multiple of 8, dv of 16): the block's keys transposed once into w.kt
// (d x BN, the tokens past nj zero), every row's scores over the whole block, then per row its range's online
// softmax (weights zero outside it), then the weighted values over the tokens some row of a register block sees.
template <class S>
inline void attend_block_gemm(int64_t M, int64_t d, int64_t dv, const float* qs, const float* const* kp,
                              const float* const* vp, int64_t t0, int64_t nj, const int64_t* lo, const int64_t* hi,
                              S& w, float* acc, float* other, const float* extra) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  const int64_t njp = (nj + 15) / 16 * 16;
  float* kt = w.kt.data();
  int64_t j8 = 0;
  for (; j8 + 8 <= nj; j8 += 8)  // eight keys' eight channels at a time, transposed in registers
    for (int64_t c = 0; c < d; c += 8) {
      __m256 r0 = _mm256_loadu_ps(kp[j8] + c), r1 = _mm256_loadu_ps(kp[j8 + 1] + c);
      __m256 r2 = _mm256_loadu_ps(kp[j8 + 2] + c), r3 = _mm256_loadu_ps(kp[j8 + 3] + c);
      __m256 r4 = _mm256_loadu_ps(kp[j8 + 4] + c), r5 = _mm256_loadu_ps(kp[j8 + 5] + c);
      __m256 r6 = _mm256_loadu_ps(kp[j8 + 6] + c), r7 = _mm256_loadu_ps(kp[j8 + 7] + c);
      const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
      const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
      const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
      const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = kt + c * BN + j8;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + BN, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * BN, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * BN, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * BN, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * BN, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * BN, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * BN, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  for (int64_t j = j8; j < nj; ++j)
    for (int64_t c = 0; c < d; ++c) kt[c * BN + j] = kp[j][c];
  for (int64_t c = 0; c < d; ++c) std::fill(kt + c * BN + nj, kt + c * BN + njp, 0.f);
  float* s = w.s.data();
  float* p = w.p.data();
  float* alpha = w.al.data();
  for (int64_t r = 0; r < M; r += GEMM_ROWS)
    with_rows(std::min<int64_t>(GEMM_ROWS, M - r), [&](auto R) { gemm_scores<R>(qs + r * d, d, kt, njp, s + r * BN); });
  for (int64_t r = 0; r < M; ++r) {
    float* sr = s + r * BN;
    float* pr = p + r * BN;
    const int64_t j0 = std::max<int64_t>(lo[r] - t0, 0), j1 = std::min<int64_t>(hi[r] - t0, nj);
    alpha[r] = 1.f;
    if (j0 >= j1) {
      std::fill(pr, pr + njp, 0.f);
      continue;
    }
    if (extra != nullptr)
      for (int64_t j = j0; j < j1; ++j) sr[j] += extra[r * BN + j];
    const float m_new = std::max(w.m[r], max_of(sr, j0, j1));
    alpha[r] = w.m[r] == NEG ? 0.f : std::exp(w.m[r] - m_new);
    std::fill(pr, pr + j0, 0.f);
    w.l[r] = w.l[r] * alpha[r] + exp_row(sr, m_new, j0, j1, pr);
    std::fill(pr + j1, pr + njp, 0.f);
    w.m[r] = m_new;
    if (other != nullptr && alpha[r] != 1.f)  // the other tier's accumulator (rotated codes) rescales too
      for (int64_t c = 0; c < dv; ++c) other[r * dv + c] *= alpha[r];
  }
  for (int64_t r = 0; r < M; r += GEMM_ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(GEMM_ROWS, M - r));
    int64_t ja = nj, jb = 0;  // the tokens any of these rows sees
    for (int k = 0; k < rows; ++k) {
      const int64_t j0 = std::max<int64_t>(lo[r + k] - t0, 0), j1 = std::min<int64_t>(hi[r + k] - t0, nj);
      if (j0 < j1) {
        ja = std::min(ja, j0);
        jb = std::max(jb, j1);
      }
    }
    if (ja < jb)
      with_rows(rows, [&](auto R) { gemm_values<R>(p + r * BN, vp, ja, jb, alpha + r, acc + r * dv, dv); });
  }
}
#endif

// One block of nj tokens of a tier, key j at kp[j] and value j at vp[j] (fp32), token t0 of the tier its first;
// row r sees the tier's tokens [lo[r], hi[r]). Scores with `qs` (M x d), weighted values into `acc` (M x dv);
// `other`: the other tier's accumulator when the tiers sum apart (a rotated quantized tier), else nullptr; `extra`:
// scores added to the rows' (M x BN, a dca source's key-bias scores), or nullptr. Two neighbouring rows that see the
// same tokens (the query heads of one KV head) are scored and summed together.
inline void attend_block(int64_t M, int64_t d, int64_t dv, const float* qs, const float* const* kp,
                         const float* const* vp, int64_t t0, int64_t nj, const int64_t* lo, const int64_t* hi,
                         Scratch& w, float* acc, float* other, const float* extra = nullptr) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
#ifdef KVK_AVX2
  if (M >= GEMM_MIN_ROWS && d % 8 == 0 && dv % 16 == 0) {
    attend_block_gemm(M, d, dv, qs, kp, vp, t0, nj, lo, hi, w, acc, other, extra);
    return;
  }
#endif
  float* s = w.s.data();
  float* p = w.p.data();
  for (int64_t r = 0; r < M;) {
    const int64_t j0 = std::max<int64_t>(lo[r] - t0, 0), j1 = std::min<int64_t>(hi[r] - t0, nj);
    if (j0 >= j1) {
      ++r;
      continue;
    }
    const bool pair = r + 1 < M && std::max<int64_t>(lo[r + 1] - t0, 0) == j0 &&
                      std::min<int64_t>(hi[r + 1] - t0, nj) == j1;  // the same tokens of this block
    const int rows = pair ? 2 : 1;
    scores(qs + r * d, pair ? qs + (r + 1) * d : nullptr, kp, j0, j1, d, s, s + BN);
    if (extra != nullptr)
      for (int k = 0; k < rows; ++k)
        for (int64_t j = j0; j < j1; ++j) s[k * BN + j] += extra[(r + k) * BN + j];
    float alpha[2] = {1.f, 1.f};
    for (int k = 0; k < rows; ++k) {
      const int64_t row = r + k;
      const float* sk = s + k * BN;
      const float mx = max_of(sk, j0, j1);
      const float m_new = std::max(w.m[row], mx);
      alpha[k] = w.m[row] == NEG ? 0.f : std::exp(w.m[row] - m_new);
      w.l[row] = w.l[row] * alpha[k] + exp_row(sk, m_new, j0, j1, p + k * BN);
      w.m[row] = m_new;
      if (other != nullptr && alpha[k] != 1.f)  // the other tier's accumulator (rotated codes) rescales too
        for (int64_t c = 0; c < dv; ++c) other[row * dv + c] *= alpha[k];
    }
    weighted_values(acc + r * dv, alpha[0], p, pair ? acc + (r + 1) * dv : nullptr, alpha[1], p + BN, vp, j0, j1, dv);
    r += rows;
  }
}

// The bytes [from, to) into the cache (L2 and up), one line at a time.
inline void prefetch_range(const uint8_t* from, const uint8_t* to) {
  const int64_t n = to - from;
  for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(from + off, 0, 2);
  // A loop of prefetches alone has no effect C++ can observe: GCC's -ffinite-loops (on from -O2) deletes the
  // caller's page walk around it. The empty volatile statement is an effect it must keep (emits nothing).
  asm volatile("");
}

// The quantized tokens [t0, t1) of row b, KV head h brought into the cache ahead of their block: their key and
// value codes, value scales and zero points, and their key groups' scales and zero points (a latent: the codes of
// the latent and the rope key, and both streams' groups' scales and zero points). A quantized page's slabs lie
// apart and its pages anywhere in the pool, so the hardware's stream prefetch does not see them coming.
inline void prefetch_quant(const PagedArgs& a, int64_t b, int64_t h, int64_t t0, int64_t t1) {
  const int64_t kcw = a.kw * a.k_bits / 8, vcw = a.vw * a.v_bits / 8, groups = a.tq / a.group;
  const int64_t kse = a.ks_dtype == F32 ? 4 : 2, vse = a.vs_dtype == F32 ? 4 : 2;
  while (t0 < t1) {
    const int64_t page = t0 / a.tq, u0 = t0 % a.tq, u1 = std::min(a.tq, u0 + t1 - t0);
    const uint8_t* base = a.arena + a.q_table[b * a.pq + page] * a.page_bytes;
    const int64_t s0 = h * a.tq + u0, s1 = h * a.tq + u1, g0 = h * groups + u0 / a.group,
                  g1 = h * groups + (u1 - 1) / a.group + 1;
    prefetch_range(base + a.kc_off + s0 * kcw, base + a.kc_off + s1 * kcw);
    prefetch_range(base + a.vc_off + s0 * vcw, base + a.vc_off + s1 * vcw);
    if (a.latent) {  // the rope key's scales and zero points: per channel over groups, as the latent's
      prefetch_range(base + a.vs_off + g0 * a.vw * vse, base + a.vs_off + g1 * a.vw * vse);
      prefetch_range(base + a.vz_off + g0 * a.vw * vse, base + a.vz_off + g1 * a.vw * vse);
    } else {
      prefetch_range(base + a.vs_off + s0 * vse, base + a.vs_off + s1 * vse);
      prefetch_range(base + a.vz_off + s0 * vse, base + a.vz_off + s1 * vse);
    }
    prefetch_range(base + a.ks_off + g0 * a.kw * kse, base + a.ks_off + g1 * a.kw * kse);
    prefetch_range(base + a.kz_off + g0 * a.kw * kse, base + a.kz_off + g1 * a.kw * kse);
    t0 += u1 - u0;
  }
}

// The exact tokens [t0, t1) of row b, KV head h (their K and V slabs' tokens: keys and values, or a latent and its
// rope key) brought into the cache ahead of their block.
inline void prefetch_exact(const PagedArgs& a, int64_t b, int64_t h, int64_t t0, int64_t t1) {
  const int64_t es = a.kv_dtype == F32 ? 4 : 2;
  while (t0 < t1) {
    const int64_t page = t0 / a.te, u0 = t0 % a.te, u1 = std::min(a.te, u0 + t1 - t0);
    const uint8_t* base = a.arena + a.exact_table[b * a.pe + page] * a.page_bytes;
    prefetch_range(base + a.k_off + (h * a.te + u0) * a.kw * es, base + a.k_off + (h * a.te + u1) * a.kw * es);
    prefetch_range(base + a.v_off + (h * a.te + u0) * a.vw * es, base + a.v_off + (h * a.te + u1) * a.vw * es);
    t0 += u1 - u0;
  }
}

#ifdef KVK_AVX2
// Rows [0, M) of one (row b, KV head h) item over the quantized tokens [qa, qb), row r seeing [q0[r], qc[r]):
// scores with `qs` (M x d; rotated when the tier is), weighted values into `acc` (M x dv); `other`: the exact
// tier's accumulator when the tiers sum apart (a rotated tier), rescaled with this one.
inline void attend_quant(const PagedArgs& a, int64_t b, int64_t h, int64_t M, const float* qs, const int64_t* q0,
                         const int64_t* qc, int64_t qa, int64_t qb, Scratch& w, float* acc, float* other) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  const int64_t d = a.d, dv = a.dv, kcw = d * a.k_bits / 8, vcw = dv * a.v_bits / 8, groups = a.tq / a.group;
  const int64_t kse = a.ks_dtype == F32 ? 4 : 2;
  float *s = w.s.data(), *p = w.p.data(), *qg = w.qg.data(), *bias = w.bias.data(), *zs = w.zs.data();
  float* sig = w.sig.data();
  int8_t* q8 = w.q8.data();
  const bool i8 = a.int_sums && int8_dot(a.k_bits, d);
  const uint8_t** kc = w.kc.data();
  const uint8_t** vc = w.vc.data();
  prefetch_quant(a, b, h, qa, std::min(qb, qa + BN));
  for (int64_t t0 = qa; t0 < qb; t0 += BN) {
    const int64_t nj = std::min(BN, qb - t0);
    if (t0 + BN < qb) prefetch_quant(a, b, h, t0 + BN, std::min(qb, t0 + 2 * BN));  // the next block's, meanwhile
    int64_t page = t0 / a.tq, u = t0 % a.tq;  // walked token by token: no division per token
    const uint8_t* base = a.arena + a.q_table[b * a.pq + page] * a.page_bytes;
    for (int64_t j = 0; j < nj; ++j, ++u) {
      if (u == a.tq) {
        u = 0;
        base = a.arena + a.q_table[b * a.pq + ++page] * a.page_bytes;
      }
      kc[j] = base + a.kc_off + (h * a.tq + u) * kcw;
      vc[j] = base + a.vc_off + (h * a.tq + u) * vcw;
      if (a.vs_dtype == F32) {
        std::memcpy(&w.vs[j], base + a.vs_off + 4 * (h * a.tq + u), 4);
        std::memcpy(&w.vz[j], base + a.vz_off + 4 * (h * a.tq + u), 4);
      } else {
        w.vs[j] = load_one(base + a.vs_off, a.vs_dtype, h * a.tq + u);
        w.vz[j] = load_one(base + a.vz_off, a.vs_dtype, h * a.tq + u);
      }
    }
    for (int64_t ja = 0; ja < nj;) {  // one key group at a time: its scales folded into the query rows
      const int64_t t = t0 + ja, u = t % a.tq, g = u / a.group;
      const int64_t jb = std::min(nj, ja + a.group - u % a.group);
      const uint8_t* base = a.arena + a.q_table[b * a.pq + t / a.tq] * a.page_bytes;
      const uint8_t* sc = base + a.ks_off + (h * groups + g) * d * kse;
      const uint8_t* zr = base + a.kz_off + (h * groups + g) * d * kse;
      for (int64_t r = 0; r < M; ++r) {
        __m256 bv = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 qv = _mm256_loadu_ps(qs + r * d + c);
          _mm256_storeu_ps(qg + r * d + c, _mm256_mul_ps(qv, load8(sc + c * kse, a.ks_dtype)));
          bv = _mm256_fmadd_ps(qv, load8(zr + c * kse, a.ks_dtype), bv);
        }
        bias[r] = hsum8(bv);
        if (i8) quantize_query_i8(qg + r * d, d, q8 + r * d, sig + r);
      }
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const float *qr = qg + r0 * d, *br = bias + r0;
        if (i8) {
          const int8_t* q8r = q8 + r0 * d;
          switch (std::min<int64_t>(4, M - r0)) {
            case 4: q_scores_i8<4>(q8r, sig + r0, br, d, kc, ja, jb, s + r0 * BN); break;
            case 3: q_scores_i8<3>(q8r, sig + r0, br, d, kc, ja, jb, s + r0 * BN); break;
            case 2: q_scores_i8<2>(q8r, sig + r0, br, d, kc, ja, jb, s + r0 * BN); break;
            default: q_scores_i8<1>(q8r, sig + r0, br, d, kc, ja, jb, s + r0 * BN); break;
          }
          continue;
        }
        switch (std::min<int64_t>(4, M - r0)) {
          case 4: q_scores<4>(qr, br, d, a.k_bits, kc, ja, jb, s + r0 * BN); break;
          case 3: q_scores<3>(qr, br, d, a.k_bits, kc, ja, jb, s + r0 * BN); break;
          case 2: q_scores<2>(qr, br, d, a.k_bits, kc, ja, jb, s + r0 * BN); break;
          default: q_scores<1>(qr, br, d, a.k_bits, kc, ja, jb, s + r0 * BN); break;
        }
      }
      ja = jb;
    }
    // online softmax per row; the weights then carry each token's value scale, zs each row's zero-point sum
    for (int64_t r = 0; r < M; ++r) {
      const int64_t j0 = std::max<int64_t>(q0[r] - t0, 0), j1 = std::min<int64_t>(qc[r] - t0, nj);
      float* pr = p + r * BN;
      zs[r] = 0.f;
      if (j1 <= j0) {
        std::fill(pr, pr + nj, 0.f);
        continue;
      }
      const float mx = max_of(s + r * BN, j0, j1), m_new = std::max(w.m[r], mx);
      const float alpha = w.m[r] == NEG ? 0.f : std::exp(w.m[r] - m_new);
      w.l[r] = w.l[r] * alpha + exp_row(s + r * BN, m_new, j0, j1, pr);
      w.m[r] = m_new;
      std::fill(pr, pr + j0, 0.f);
      std::fill(pr + j1, pr + nj, 0.f);
      if (alpha != 1.f) {
        for (int64_t c = 0; c < dv; ++c) acc[r * dv + c] *= alpha;
        if (other != nullptr)
          for (int64_t c = 0; c < dv; ++c) other[r * dv + c] *= alpha;
      }
      zs[r] = fold_value_scales(pr, w.vs.data(), w.vz.data(), j0, j1);
    }
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const float* pr = p + r0 * BN;
      float* ar = acc + r0 * dv;
      switch (std::min<int64_t>(4, M - r0)) {
        case 4: q_values<4>(pr, zs + r0, ar, dv, a.v_bits, vc, nj); break;
        case 3: q_values<3>(pr, zs + r0, ar, dv, a.v_bits, vc, nj); break;
        case 2: q_values<2>(pr, zs + r0, ar, dv, a.v_bits, vc, nj); break;
        default: q_values<1>(pr, zs + r0, ar, dv, a.v_bits, vc, nj); break;
      }
    }
  }
}
#endif

// The query rows of one item's tile, their ranges, and what they see of each tier.
struct Rows {
  int64_t b, h, i0, i1, rep, M, q_max = 0, e_min = INT64_MAX, e_max = 0;
  bool rotated;
};

// Query token i of row b's codes seen, [q0, q): `ranges`' first entry and, in a 4-column `ranges`, its fourth.
inline void codes_seen(const PagedArgs& a, const int32_t* rg, int64_t& q0, int64_t& q) {
  q = rg[0];
  q0 = a.rstride > 3 ? std::min<int64_t>(rg[3], q) : 0;
}

inline Rows rows_of(const PagedArgs& a, int64_t item) {
  Rows x;
  const int64_t tile = item % a.tiles;
  x.h = (item / a.tiles) % a.kv_items;
  x.b = item / (a.tiles * a.kv_items);
  x.rep = a.Hq / a.kv_items;
  x.i0 = tile * a.tile_tokens;
  x.i1 = std::min(a.n, x.i0 + a.tile_tokens);
  x.M = (x.i1 - x.i0) * x.rep;
  for (int64_t i = x.i0; i < x.i1; ++i) {
    const int32_t* rg = a.ranges + (x.b * a.n + i) * a.rstride;
    int64_t q0, q;
    codes_seen(a, rg, q0, q);
    if (q > q0) x.q_max = std::max<int64_t>(x.q_max, q);
    if (a.rstride > 5 && a.tq > 0 && rg[5] > rg[4]) x.q_max = std::max<int64_t>(x.q_max, rg[5]);
    if (rg[2] > rg[1]) {
      x.e_min = std::min<int64_t>(x.e_min, rg[1]);
      x.e_max = std::max<int64_t>(x.e_max, rg[2]);
    }
  }
  x.rotated = a.rotation != nullptr && x.q_max > 0;
  return x;
}

// out = (acc_q R + acc_e) / l for the rows of `x`, back to (b, h * rep + r, i); acc_q: nullptr unless rotated.
inline void finalize(const PagedArgs& a, const Rows& x, const float* acc_e, const float* acc_q, const float* m,
                     const float* l) {
  const int64_t dv = a.dv;
  for (int64_t i = x.i0; i < x.i1; ++i) {
    for (int64_t r = 0; r < x.rep; ++r) {
      const int64_t row = (i - x.i0) * x.rep + r;
      float* dst = a.out + ((x.b * a.Hq + x.h * x.rep + r) * a.n + i) * a.ow;
      const float inv = l[row] > 0.f ? 1.f / l[row] : 0.f;
      if (a.lse != nullptr)
        a.lse[(x.b * a.Hq + x.h * x.rep + r) * a.n + i] =
            l[row] > 0.f ? m[row] + std::log(l[row]) : -std::numeric_limits<float>::infinity();
      if (a.posthoc && !a.rebuild_values) {  // the weighted latent's value side, once a row: (acc / l) P_v,h + mu_v,h
        const int64_t d = a.hd;  // (a rotated tier's latents, summed apart, through R P_v,h); a dca source's: every
        for (int64_t g = a.mixed ? 0 : x.h; g < (a.mixed ? a.H : x.h + 1); ++g) {  // head's, side by side
          float* out = dst + (a.mixed ? g * d : 0);
          const float* mu = a.value_mean + g * d;
          for (int64_t c = 0; c < d; ++c) out[c] = mu[c];
          for (int t = 0; t < (acc_q != nullptr ? 2 : 1); ++t) {
            const float* acc = (t == 0 ? acc_e : acc_q) + row * dv;
            const float* P = (t == 0 ? a.value_up : a.value_up_rot) + g * dv * d;
            for (int64_t k = 0; k < dv; ++k) {
              const float f = acc[k] * inv;
              for (int64_t c = 0; c < d; ++c) out[c] += f * P[k * d + c];
            }
          }
        }
        continue;
      }
      if (a.posthoc) {  // values rebuilt per block (a rotated tier's with R P_v,h): both tiers' sums in the same space
        for (int64_t c = 0; c < dv; ++c)
          dst[c] = (acc_e[row * dv + c] + (acc_q != nullptr ? acc_q[row * dv + c] : 0.f)) * inv;
        continue;
      }
      for (int64_t c = 0; c < dv; ++c) {
        float o = acc_e[row * dv + c];
        if (acc_q != nullptr) o += dot(acc_q + row * dv, a.rotation + c * a.d, dv);  // R's first dv x dv
        dst[c] = o * inv;
      }
    }
  }
}

// One work unit: split `unit % splits` of item `unit / splits` (row b, KV head h, query tile), i.e. its share of
// the item's blocks of BN tokens (the quantized tier's, then the exact tier's). With one split it writes the
// output; with more, its running max, sum and accumulators go to a.partial for merge_item.
inline void run_item(const PagedArgs& a, int64_t unit, Scratch& w) {
  const int64_t item = unit / a.splits, split = unit % a.splits;
  const int64_t tile = item % a.tiles, h = (item / a.tiles) % a.kv_items, b = item / (a.tiles * a.kv_items);
  const int64_t rep = a.Hq / a.kv_items, d = a.d, dv = a.dv;
  // the rows' scoring width: d, or a dca source's H kw (its rows' last kw channels score the key bias apart)
  const int64_t dk = a.mixed ? a.H * a.hd : d;
  const int64_t hs = a.posthoc ? 0 : h;  // the slabs' head: a post-hoc latent's one head serves every KV head
  const int64_t heads_read = a.mixed && !a.posthoc ? a.H : 1;  // slabs a block reads: a dca source's every head
  const int64_t i0 = tile * a.tile_tokens, i1 = std::min(a.n, i0 + a.tile_tokens), M = (i1 - i0) * rep;
  // rows: token-major within the tile, the rep query heads of KV head h together
  std::vector<int64_t> qc(M), q0(M), elo(M), ehi(M), slo(M, 0), shi(M, 0);
  int64_t q_min = INT64_MAX, q_max = 0, e_min = INT64_MAX, e_max = 0, s_min = INT64_MAX, s_max = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const int32_t* rg = a.ranges + (b * a.n + i) * a.rstride;
    int64_t lo, q;
    codes_seen(a, rg, lo, q);
    for (int64_t r = 0; r < rep; ++r) {
      const int64_t row = (i - i0) * rep + r;
      qc[row] = q;
      q0[row] = lo;
      elo[row] = rg[1];
      ehi[row] = rg[2];
      if (a.rstride > 5) {
        slo[row] = rg[4];
        shi[row] = rg[5];
      }
      const int64_t at = ((b * a.Hq + h * rep + r) * a.n + i) * d;
      for (int64_t c = 0; c < dk; ++c) w.q[row * dk + c] = a.query[at + c] * a.scaling;
      if (a.query_rot != nullptr)  // q R (R symmetric): scores against rotated codes
        for (int64_t c = 0; c < dk; ++c) w.qr[row * dk + c] = a.query_rot[at + c] * a.scaling;
      if (a.mixed)
        for (int64_t c = 0; c < a.hd; ++c) w.qb[row * a.hd + c] = a.query[at + dk + c] * a.scaling;
    }
    if (q > lo) {
      q_min = std::min<int64_t>(q_min, lo);
      q_max = std::max<int64_t>(q_max, q);
    }
    if (rg[2] > rg[1]) {
      e_min = std::min<int64_t>(e_min, rg[1]);
      e_max = std::max<int64_t>(e_max, rg[2]);
    }
    if (a.rstride > 5 && rg[5] > rg[4]) {
      s_min = std::min<int64_t>(s_min, rg[4]);
      s_max = std::max<int64_t>(s_max, rg[5]);
    }
  }
  const bool sinks = split == 0 && s_max > s_min, sink_codes = sinks && a.tq > 0;
  const bool rotated = a.rotation != nullptr && (q_max > 0 || (a.rstride > 5 && a.tq > 0 && s_max > s_min));
  // this split's blocks: [k0, k1) of the nbq quantized blocks (from the first code a row sees) then the exact ones
  if (q_max == 0) q_min = 0;
  const int64_t nbq = (q_max - q_min + BN - 1) / BN, nbe = e_max > e_min ? (e_max - e_min + BN - 1) / BN : 0;
  const int64_t k0 = split * (nbq + nbe) / a.splits, k1 = (split + 1) * (nbq + nbe) / a.splits;
  const int64_t qa = q_min + std::min(k0, nbq) * BN, qb = std::min(q_min + std::min(k1, nbq) * BN, q_max);
  const int64_t ea = e_min + std::max<int64_t>(k0 - nbq, 0) * BN;
  const int64_t eb = std::min(e_min + std::max<int64_t>(k1 - nbq, 0) * BN, e_max);
  std::fill(w.m.begin(), w.m.begin() + M, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + M, 0.f);
  std::fill(w.acc_e.begin(), w.acc_e.begin() + M * dv, 0.f);
  float* acc_e = w.acc_e.data();
  float* acc_q = acc_e;
  if (rotated) {
    std::fill(w.acc_q.begin(), w.acc_q.begin() + M * dv, 0.f);
    acc_q = w.acc_q.data();
  }
  const float** kp = w.kp.data();
  const float** vp = w.vp.data();
  // the quantized tier: keys per channel over groups, values per token (a latent: the latent and the rope key
  // both per channel over groups); read from the codes where it can be (attend_quant), else widened into the
  // scratch
#ifdef KVK_AVX2
  // fused for a few rows (a decode: the query heads of one KV head); many rows (a prefill tile) amortize one
  // widening of each token over all of them instead, as do a latent's rows (every query head of the layer reads
  // its one head: one widening of a token serves them all, where folding scales into the query costs each row)
  const bool fused = !a.latent && !a.posthoc && !a.mixed && d % 16 == 0 && dv % 16 == 0 && M <= 8;
#else
  const bool fused = false;
#endif
  // codes [qa, qb), row r seeing [lo_r[r], hi_r[r])
  auto quant_pass = [&](int64_t qa, int64_t qb, const int64_t* lo_r, const int64_t* hi_r) {
#ifdef KVK_AVX2
  if (qb > qa && fused)
    attend_quant(a, b, h, M, rotated ? w.qr.data() : w.q.data(), lo_r, hi_r, qa, qb, w, acc_q,
                 rotated ? acc_e : nullptr);
#endif
  if (qb > qa && !fused) {
    const int64_t kcw = a.kw * a.k_bits / 8, vcw = a.vw * a.v_bits / 8, groups = a.tq / a.group;
    const int64_t kse = a.ks_dtype == F32 ? 4 : 2, vse = a.vs_dtype == F32 ? 4 : 2;
    // a latent's keys are wide: a block stays in L1 (exact_pass)
    const int64_t bn = a.latent ? KVK_LATENT_BN : (a.posthoc || a.mixed) ? KVK_SCRATCH_BN : BN;
    for (int64_t g = 0; g < heads_read; ++g) prefetch_quant(a, b, hs + g, qa, std::min(qb, qa + bn));
    for (int64_t t0 = qa; t0 < qb; t0 += bn) {
      const int64_t nj = std::min(bn, qb - t0);
      if (t0 + bn < qb)
        for (int64_t g = 0; g < heads_read; ++g) prefetch_quant(a, b, hs + g, t0 + bn, std::min(qb, t0 + 2 * bn));
      for (int64_t j = 0; j < nj; ++j) {
        const int64_t t = t0 + j, u = t % a.tq, g = hs * groups + u / a.group, slot = hs * a.tq + u;
        const uint8_t* base = a.arena + a.q_table[b * a.pq + t / a.tq] * a.page_bytes;
        if (a.mixed && !a.posthoc) {  // every source head's key and value in the scratch, the token's position
          mixed_quant(a, base, u, w.k.data() + j * dk, w.v.data() + j * dv);
          kp[j] = w.k.data() + j * dk;
          vp[j] = w.v.data() + j * dv;
          w.pos[j] = a.positions[b * a.pos_stride + t];
          continue;
        }
        if (a.posthoc) {  // the latent c_t, widened: the value, and what the block's keys are rebuilt from
          float* cj = w.v.data() + j * a.kw;
          widen_channel(base + a.kc_off + slot * kcw, a.k_bits, base + a.ks_off + g * a.kw * kse,
                        base + a.kz_off + g * a.kw * kse, a.ks_dtype, a.kw, cj);
          vp[j] = cj;
          w.pos[j] = a.positions[b * a.pos_stride + t];
          continue;
        }
        float* kj = w.k.data() + j * d;
        widen_channel(base + a.kc_off + slot * kcw, a.k_bits, base + a.ks_off + g * a.kw * kse,
                      base + a.kz_off + g * a.kw * kse, a.ks_dtype, a.kw, kj);
        if (a.latent) {  // key (c_t, k_rope_t): the rope key per channel over the group too; the value c_t
          widen_channel(base + a.vc_off + slot * vcw, a.v_bits, base + a.vs_off + g * a.vw * vse,
                        base + a.vz_off + g * a.vw * vse, a.vs_dtype, a.vw, kj + a.kw);
          vp[j] = kj;
        } else {
          float* vj = w.v.data() + j * dv;
          widen_token(base + a.vc_off + slot * vcw, a.v_bits, load_one(base + a.vs_off, a.vs_dtype, slot),
                      load_one(base + a.vz_off, a.vs_dtype, slot), dv, vj);
          vp[j] = vj;
        }
        kp[j] = kj;
      }
      if (a.posthoc && a.mixed)
        mixed_latent_block(a, nj, w, kp, vp, a.rotation != nullptr);
      else if (a.posthoc)
        posthoc_block(a, h, nj, w, kp, vp, a.rotation != nullptr);
      if (a.mixed) mixed_bias_scores(a, M, nj, w);
      // a rotated post-hoc tier is rebuilt with rotated bases: its keys are not rotated, nor is its query
      attend_block(M, dk, dv, rotated && !a.posthoc ? w.qr.data() : w.q.data(), kp, vp, t0, nj, lo_r, hi_r, w, acc_q,
                   rotated ? acc_e : nullptr, a.mixed ? w.bs.data() : nullptr);
    }
  }
  };
  // the exact tier: fp32 tokens read where they lie, others widened into the scratch (a latent's blocks are
  // shorter: its keys are wide and every query head reads them, so a block stays in L1 while they do); slots
  // [ea, eb), row r seeing [lo_r[r], hi_r[r])
  auto exact_pass = [&](int64_t ea, int64_t eb, const int64_t* lo_r, const int64_t* hi_r) {
  if (eb > ea) {
    const int64_t es = a.kv_dtype == F32 ? 4 : 2;
    const int64_t bn = a.latent ? KVK_LATENT_BN : (a.posthoc || a.mixed) ? KVK_SCRATCH_BN : BN;
    for (int64_t g = 0; g < heads_read; ++g) prefetch_exact(a, b, hs + g, ea, std::min(eb, ea + bn));
    for (int64_t t0 = ea; t0 < eb; t0 += bn) {
      const int64_t nj = std::min(bn, eb - t0);
      if (t0 + bn < eb)  // the next block's, meanwhile
        for (int64_t g = 0; g < heads_read; ++g) prefetch_exact(a, b, hs + g, t0 + bn, std::min(eb, t0 + 2 * bn));
      int64_t page = t0 / a.te, u = t0 % a.te;  // pages walked token by token: no division per token
      const uint8_t* base = a.arena + a.exact_table[b * a.pe + page] * a.page_bytes;
      for (int64_t j = 0; j < nj; ++j, ++u) {
        if (u == a.te) {
          u = 0;
          base = a.arena + a.exact_table[b * a.pe + ++page] * a.page_bytes;
        }
        const uint8_t* kb = base + a.k_off + (hs * a.te + u) * a.kw * es;
        const uint8_t* vb = base + a.v_off + (hs * a.te + u) * a.vw * es;
        if (a.mixed && !a.posthoc) {  // every source head's key and value in the scratch, the token's position
          mixed_exact(a, base, u, w.k.data() + j * dk, w.v.data() + j * dv);
          kp[j] = w.k.data() + j * dk;
          vp[j] = w.v.data() + j * dv;
          w.pos[j] = a.positions[b * a.pos_stride + a.pq * a.tq + t0 + j];
        } else if (a.posthoc) {  // the latent c_t: the value (in place when fp32), what the keys are rebuilt from
          if (a.kv_dtype == F32) {
            vp[j] = reinterpret_cast<const float*>(kb);
          } else {
            widen_exact(kb, a.kv_dtype, a.kw, w.v.data() + j * a.kw);
            vp[j] = w.v.data() + j * a.kw;
          }
          w.pos[j] = a.positions[b * a.pos_stride + a.pq * a.tq + t0 + j];
        } else if (a.latent) {  // key (c_t, k_rope_t) assembled in the scratch, the value its first dv channels (c_t)
          float* kj = w.k.data() + j * d;
          widen_exact(kb, a.kv_dtype, a.kw, kj);
          widen_exact(vb, a.kv_dtype, a.vw, kj + a.kw);
          kp[j] = kj;
          vp[j] = kj;
        } else if (a.kv_dtype == F32) {
          kp[j] = reinterpret_cast<const float*>(kb);
          vp[j] = reinterpret_cast<const float*>(vb);
        } else {
          widen_exact(kb, a.kv_dtype, d, w.k.data() + j * d);
          widen_exact(vb, a.kv_dtype, dv, w.v.data() + j * dv);
          kp[j] = w.k.data() + j * d;
          vp[j] = w.v.data() + j * dv;
        }
      }
      if (a.posthoc && a.mixed)
        mixed_latent_block(a, nj, w, kp, vp, false);
      else if (a.posthoc)
        posthoc_block(a, h, nj, w, kp, vp, false);
      if (a.mixed) mixed_bias_scores(a, M, nj, w);
      attend_block(M, dk, dv, w.q.data(), kp, vp, t0, nj, lo_r, hi_r, w, acc_e, rotated ? acc_q : nullptr,
                   a.mixed ? w.bs.data() : nullptr);
    }
  }
  };
  if (sinks) {  // the attention sinks first (split 0 only): the online softmax takes the blocks in any order
    if (sink_codes)
      quant_pass(s_min, s_max, slo.data(), shi.data());
    else
      exact_pass(s_min, s_max, slo.data(), shi.data());
  }
  quant_pass(qa, qb, q0.data(), qc.data());
  exact_pass(ea, eb, elo.data(), ehi.data());
  if (a.splits == 1) {
    finalize(a, rows_of(a, item), acc_e, rotated ? acc_q : nullptr, w.m.data(), w.l.data());
    return;
  }
  const int64_t R = a.tile_tokens * rep;  // the partial's rows: m, l, acc_e, then acc_q (with a rotation)
  float* part = a.partial + unit * a.part_stride;
  std::copy(w.m.begin(), w.m.begin() + M, part);
  std::copy(w.l.begin(), w.l.begin() + M, part + R);
  std::copy(acc_e, acc_e + M * dv, part + 2 * R);
  if (a.rotation != nullptr) {
    if (rotated)
      std::copy(acc_q, acc_q + M * dv, part + 2 * R + R * dv);
    else
      std::fill(part + 2 * R + R * dv, part + 2 * R + 2 * R * dv, 0.f);
  }
}

// Item `item`'s splits combined (FlashDecoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html): each
// split's sums rescaled to the largest running max, added, then the output written as with one split.
inline void merge_item(const PagedArgs& a, int64_t item, Scratch& w) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  const Rows x = rows_of(a, item);
  const int64_t R = a.tile_tokens * x.rep, dv = a.dv;
  const float* first = a.partial + item * a.splits * a.part_stride;
  for (int64_t r = 0; r < x.M; ++r) {
    float m = NEG;
    for (int64_t sp = 0; sp < a.splits; ++sp) m = std::max(m, first[sp * a.part_stride + r]);
    float l = 0.f;
    float* acc_e = w.acc_e.data() + r * dv;
    float* acc_q = x.rotated ? w.acc_q.data() + r * dv : nullptr;
    std::fill(acc_e, acc_e + dv, 0.f);
    if (acc_q != nullptr) std::fill(acc_q, acc_q + dv, 0.f);
    for (int64_t sp = 0; sp < a.splits; ++sp) {
      const float* part = first + sp * a.part_stride;
      if (part[r] == NEG) continue;  // this split saw none of the row's tokens
      const float f = std::exp(part[r] - m);
      l += f * part[R + r];
      const float* pe = part + 2 * R + r * dv;
      for (int64_t c = 0; c < dv; ++c) acc_e[c] += f * pe[c];
      if (acc_q != nullptr) {
        const float* pq = part + 2 * R + R * dv + r * dv;
        for (int64_t c = 0; c < dv; ++c) acc_q[c] += f * pq[c];
      }
    }
    w.l[r] = l;
    w.m[r] = m;
  }
  finalize(a, x, w.acc_e.data(), x.rotated ? w.acc_q.data() : nullptr, w.m.data(), w.l.data());
}

inline Scratch scratch(const PagedArgs& a) {
  const int64_t rows = a.tile_tokens * (a.Hq / a.kv_items);
  Scratch w;
  w.m.resize(rows);
  w.l.resize(rows);
  w.s.resize(std::max<int64_t>(rows, 2) * BN);
  w.p.resize(std::max<int64_t>(rows, 2) * BN);
  w.qg.resize(rows * a.d);
  w.q8.resize(rows * a.d);
  w.sig.resize(rows);
  w.al.resize(rows);
  w.kt.resize(BN * a.d);
  w.bias.resize(rows);
  w.zs.resize(rows);
  w.vs.resize(BN);
  w.vz.resize(BN);
  w.kc.resize(BN);
  w.vc.resize(BN);
  w.k.resize(BN * a.d);
  w.v.resize(BN * std::max(a.dv, a.kw));
  w.vr.resize(a.posthoc && a.rebuild_values ? BN * a.d : 0);
  w.kp.resize(BN);
  w.vp.resize(BN);
  w.pos.resize(a.posthoc || a.mixed ? BN : 0);
  w.qb.resize(a.mixed ? rows * a.hd : 0);
  w.rb.resize(a.mixed ? a.H * BN * a.hd : 0);
  w.kg.resize(a.mixed && a.posthoc ? BN * a.hd : 0);
  w.bs.resize(a.mixed ? rows * BN : 0);
  w.q.resize(rows * a.d);
  w.qr.resize(a.rotation ? rows * a.d : 0);
  w.acc_e.resize(rows * a.dv);
  w.acc_q.resize(a.rotation ? rows * a.dv : 0);
  return w;
}

inline void run_items(const PagedArgs& a, int64_t begin, int64_t end) {
  Scratch w = scratch(a);
  for (int64_t unit = begin; unit < end; ++unit) run_item(a, unit, w);
}

inline void merge_items(const PagedArgs& a, int64_t begin, int64_t end) {
  Scratch w = scratch(a);
  for (int64_t item = begin; item < end; ++item) merge_item(a, item, w);
}
