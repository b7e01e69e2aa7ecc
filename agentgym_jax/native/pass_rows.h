// The strips' x laid out pass by pass; shared by the strip kernels (strip_matmul.cc, bf16_gemm.cc, pair_strips.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace agentgym {

// Passes [p0, p1) of x's m rows of `words` elements into out in the pass layout: passes of `per_pass` rows (the last
// may hold fewer, R), each [words][R], element j of row r at j R + r of its pass, which starts at element
// first_row x words. element(r, j) gives row r's element j as Out. Written in order, reading a pass's rows side by
// side.
template <typename Out, typename Element>
void LayPasses(int64_t m, int64_t words, int64_t per_pass, int64_t p0, int64_t p1, Out* out, Element&& element) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t first = p * per_pass, rows = std::min(per_pass, m - first);
    Out* pass = out + first * words;
    for (int64_t j = 0; j < words; ++j)
      for (int64_t r = 0; r < rows; ++r) pass[j * rows + r] = element(first + r, j);
  }
}

// x's m rows of `words` 32-bit elements T each (fp32 numbers, or bf16 pairs as uint32_t) in LayPasses' layout. A
// pass's broadcasts then read one stream at fixed offsets, where eight row pointers and the prefetch's state had
// spilled the products' inner loop to the stack (a batch-32 decode step's products ran at ~80% of the dot-product
// peak against the prefill's 92-97%). One row is x itself.
template <typename T>
std::vector<T> PassRows(const void* x, int64_t m, int64_t words, int64_t per_pass) {
  static_assert(sizeof(T) == 4, "PassRows moves 32-bit elements");
  const auto* in = static_cast<const char*>(x);
  std::vector<T> out(m * words);
  LayPasses(m, words, per_pass, 0, (m + per_pass - 1) / per_pass, out.data(), [&](int64_t r, int64_t j) {
    T value;
    std::memcpy(&value, in + (r * words + j) * sizeof(T), sizeof(T));
    return value;
  });
  return out;
}

// Passes [p0, p1) of bf16 x (its bits, m rows of k numbers) widened to fp32 into out (m x k floats) in LayPasses'
// layout.
inline void WidenPasses(const uint16_t* x, int64_t m, int64_t k, int64_t per_pass, int64_t p0, int64_t p1,
                        float* out) {
  LayPasses(m, k, per_pass, p0, p1, out, [&](int64_t r, int64_t j) {
    const uint32_t bits = uint32_t{x[r * k + j]} << 16;  // bf16 is fp32's upper half
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  });
}

}  // namespace agentgym
