// bf16 operands in pair rows (two bf16 numbers of consecutive contraction index side by side in each 32-bit lane):
// how the pair-row strips are packed (AVX512-BW; pair_strips.cc, bf16_gemm.cc, bf16_attention.cc) and, on CPUs with
// AVX512-BF16, what vdpbf16ps multiplies: a dot product against a pair broadcast from memory.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace agentgym {

#ifdef __AVX512BW__
// 16 pairs (a[i], b[i]) of 16 bf16 numbers a and b: one pair row of 16 columns.
inline __m512i InterleavePairs(__m256i a, __m256i b) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}

// The same from the first `lanes` numbers at a and b (zeros past them).
inline __m512i InterleavePairs(const uint16_t* a, const uint16_t* b, __mmask16 lanes = 0xFFFF) {
  return InterleavePairs(_mm256_maskz_loadu_epi16(lanes, a), _mm256_maskz_loadu_epi16(lanes, b));
}

// Columns [col, col + width) of w [K, N] (bf16 bits) as pair rows [K/2][width][2] (K even, width a multiple of 16).
inline void PackPairPanel(const uint16_t* w, int64_t k_size, int64_t n, int64_t col, int64_t width, uint16_t* out) {
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    const uint16_t* even = w + 2 * kp * n + col;
    uint16_t* row = out + kp * width * 2;
    for (int64_t c = 0; c < width; c += 16) _mm512_storeu_si512(row + 2 * c, InterleavePairs(even + c, even + n + c));
  }
}
#endif

#ifdef __AVX512BF16__
// The pair of bf16 numbers at p (p[0], p[1]) in every lane.
inline __m512bh BroadcastPair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

inline __m512bh LoadPairs(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
#endif

}  // namespace agentgym
