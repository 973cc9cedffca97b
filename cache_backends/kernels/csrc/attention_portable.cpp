// The paged-attention kernel in portable C++ (any CPU; what runs where AVX2, FMA or F16C is missing).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_args.h"

namespace kvserve {
namespace portable {
#include "attention_impl.h"
}  // namespace portable

void paged_attention_portable(const PagedArgs& a, int64_t begin, int64_t end) { portable::run_items(a, begin, end); }
void paged_merge_portable(const PagedArgs& a, int64_t begin, int64_t end) { portable::merge_items(a, begin, end); }
}  // namespace kvserve
