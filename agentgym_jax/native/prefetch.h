// Bringing the next panel of packed weights into L2 while a decode step's product computes on the current one;
// shared by the strip kernels (strip_matmul.cc, bf16_gemm.cc).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace agentgym {

// per_step cache lines of `count` from `lines`, asked for at each step of a block's loop (none: count 0). A decode
// step's product of 32 rows reads each panel's strips from memory in its first pass over 8 rows and from L2 in the
// three others, so the first pass waited on memory; fetching the next panel during all four spreads those reads out
// (Zen 4, batch 32 bf16: the output head 6.4 -> 5.2 ms, a decode step ~1.5 ms faster).
struct Prefetch {
  static constexpr int64_t kLineBytes = 64;

  const char* lines = nullptr;
  int64_t count = 0, per_step = 0;

  // The share of pass `pass` (of `passes`) of the `bytes` bytes at `next`, over a loop of `steps` steps.
  static Prefetch Share(const void* next, int64_t bytes, int64_t pass, int64_t passes, int64_t steps) {
    const int64_t lines = bytes / kLineBytes, from = lines * pass / passes, to = lines * (pass + 1) / passes;
    return Prefetch{static_cast<const char*>(next) + kLineBytes * from, to - from, (to - from + steps - 1) / steps};
  }

  inline void Step(int64_t step) const {
    for (int64_t i = step * per_step, end = std::min(count, i + per_step); i < end; ++i)
      _mm_prefetch(lines + kLineBytes * i, _MM_HINT_T1);
  }
};

}  // namespace agentgym
