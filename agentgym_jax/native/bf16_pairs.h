// AVX512-BF16 helpers shared by bf16_gemm.cc and bf16_attention.cc: operands in pair rows (two bf16 numbers of
// consecutive contraction index side by side in each 32-bit lane, what vdpbf16ps multiplies) and a dot product
// against a pair broadcast from memory.
#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace agentgym {

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

// The pair of bf16 numbers at p (p[0], p[1]) in every lane.
inline __m512bh BroadcastPair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

inline __m512bh LoadPairs(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

}  // namespace agentgym
#endif
