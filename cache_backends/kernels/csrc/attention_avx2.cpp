// The paged-attention kernel built for AVX2 + FMA + F16C (chosen at run time when the CPU reports them).
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_args.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kvserve {
namespace avx2 {
#define KVK_AVX2 1
#include "attention_impl.h"
#undef KVK_AVX2
}  // namespace avx2

void paged_attention_avx2(const PagedArgs& a, int64_t begin, int64_t end) { avx2::run_items(a, begin, end); }
void paged_merge_avx2(const PagedArgs& a, int64_t begin, int64_t end) { avx2::merge_items(a, begin, end); }
}  // namespace kvserve
#pragma GCC pop_options
