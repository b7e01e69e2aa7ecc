// AVX-512 helpers shared by the native kernels: exponentials and bf16 loads and stores.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>

namespace agentgym {

// e^x for 16 lanes: x = k ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
// below 2e-7), times 2^k by scalef, which also takes very negative x to 0.
inline __m512 Exp16(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

inline __mmask16 Lanes(int64_t left) {  // the first min(left, 16) lanes
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (left > 0 ? left : 0)) - 1);
}

inline __m512 Load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }

inline __m512 WidenBf16(__m256i bits) {  // bf16 bits as the fp32 numbers they are: shifted into the top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 Load16(const uint16_t* p, __mmask16 lanes) {  // bf16 bits, widened
  return WidenBf16(_mm256_maskz_loadu_epi16(lanes, p));
}

// 16 fp32 lanes rounded to bf16 bits the way XLA's convert rounds them: to nearest, ties to even, subnormals kept
// (vcvtneps2bf16 flushes them), NaNs kept quiet NaNs.
inline __m256i RoundToBf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// bf16 bits of silu(g) * u for fp32 products g and u, computed as the model's unfused bf16 path does: g and u
// rounded to bf16 (the projections' outputs), the rest in fp32 (sigmoid as 1 / (1 + e^-g)), rounded once.
inline __m256i SwiGLU16(__m512 gate, __m512 up) {
  const __m512 g = WidenBf16(RoundToBf16(gate)), u = WidenBf16(RoundToBf16(up));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 d = _mm512_add_ps(one, Exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 sigmoid = _mm512_rcp14_ps(d);  // 1 / d to 14 bits, then one Newton step (a division took 3x as long)
  sigmoid = _mm512_mul_ps(sigmoid, _mm512_fnmadd_ps(d, sigmoid, _mm512_set1_ps(2.0f)));
  return RoundToBf16(_mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u));
}

}  // namespace agentgym
#endif
