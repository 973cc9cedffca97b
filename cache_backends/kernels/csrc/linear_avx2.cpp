// y = x W^T (+ bias) for a few rows of x (a decode step's batch): the weight streamed from memory once, each pair
// of its rows multiplied by up to 6 rows of x held in registers, and read ahead two rows in front so that the loads
// from memory overlap the FMAs (built for AVX2 + FMA, chosen at run time as the attention kernel is).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvserve {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r, n + j] = x_r · w_j (+ bias) for the R rows of x at x (row stride K) and the J (1 or 2) weight rows at w.
template <int R, int J>
inline void tile(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t ldy) {
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t{7}, ahead = 2 * K;  // read ahead: two weight rows in front
  for (int64_t k = 0; k < K8; k += 8) {
    if ((k & 15) == 0)
      for (int j = 0; j < J; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + ahead + k), _MM_HINT_T0);
    __m256 wv[J];
    for (int j = 0; j < J; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t k = K8; k < K; ++k) s += w[j * K + k] * x[r * K + k];
      y[r * ldy + j] = bias ? s + bias[j] : s;
    }
}

template <int J>
inline void rows_of_x(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N) {
  for (int64_t m = 0; m < M; m += 6) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(6, M - m)) {
      case 6: tile<6, J>(xm, K, w, bias, ym, N); break;
      case 5: tile<5, J>(xm, K, w, bias, ym, N); break;
      case 4: tile<4, J>(xm, K, w, bias, ym, N); break;
      case 3: tile<3, J>(xm, K, w, bias, ym, N); break;
      case 2: tile<2, J>(xm, K, w, bias, ym, N); break;
      default: tile<1, J>(xm, K, w, bias, ym, N); break;
    }
  }
}

}  // namespace

// Columns [n0, n1) of y (M x N, row-major) = x (M x K) times rows [n0, n1) of w (N x K), plus bias[n] if given.
void skinny_linear_avx2(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                        int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) rows_of_x<2>(x, M, K, w + n * K, bias ? bias + n : nullptr, y + n, N);
  if (n < n1) rows_of_x<1>(x, M, K, w + n * K, bias ? bias + n : nullptr, y + n, N);
}

}  // namespace kvserve
#pragma GCC pop_options
