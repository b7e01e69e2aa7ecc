// Decode-step attention over a KV cache, for XLA's CPU backend (an XLA FFI custom call).
//
// One query per row attends over the first limits[b] slots of its row's cache: keys [B, K, H, T] and values
// [B, K, T, H], fp32 or bf16 bits (uint16), the layouts of agentgym_jax.attention. XLA's own lowering of this step
// copied the bf16 cache out as fp32 for every layer and step and read every slot of the window; this reads each
// cache entry once, widens it in registers, and stops at each row's own length. Pure-JAX reference:
// agentgym_jax.attention.attend_one_query (tests/test_native_kernels.py compares the two).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Widen(float x) { return x; }

inline float Widen(uint16_t bits) {  // bf16 bits are the top half of the same fp32 number
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

#ifdef __AVX512F__
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
#endif

// s[t] = exp(s[t] - max(s)) for t < n; returns their sum.
inline float SoftmaxNumerators(float* s, int64_t n) {
  float top = s[0];
  for (int64_t t = 1; t < n; ++t) top = std::max(top, s[t]);
  int64_t t = 0;
  float total = 0.0f;
#ifdef __AVX512F__
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  return total;
}

// One (row, kv head): its `groups` queries q [G, H] over keys [H, T] and values [T, H], slots [0, n).
// scores: scratch of G * n floats; out: [G, H].
template <typename Raw>
void AttendHead(const float* q, const Raw* keys, const Raw* values, int64_t groups, int64_t head_dim,
                int64_t slots, int64_t n, float scale, float* scores, float* out) {
  std::fill(out, out + groups * head_dim, 0.0f);
  std::fill(scores, scores + groups * n, 0.0f);
  for (int64_t h = 0; h < head_dim; ++h) {  // each key row read once for all the group's queries
    const Raw* row = keys + h * slots;
    for (int64_t g = 0; g < groups; ++g) {
      const float qg = q[g * head_dim + h] * scale;
      float* s = scores + g * n;
      for (int64_t t = 0; t < n; ++t) s[t] += qg * Widen(row[t]);
    }
  }
  std::vector<float> totals(groups);
  for (int64_t g = 0; g < groups; ++g) totals[g] = SoftmaxNumerators(scores + g * n, n);
  for (int64_t t = 0; t < n; ++t) {  // each value row read once for all the group's queries
    const Raw* row = values + t * head_dim;
    for (int64_t g = 0; g < groups; ++g) {
      const float p = scores[g * n + t];
      float* o = out + g * head_dim;
      for (int64_t h = 0; h < head_dim; ++h) o[h] += p * Widen(row[h]);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inverse = 1.0f / totals[g];
    for (int64_t h = 0; h < head_dim; ++h) out[g * head_dim + h] *= inverse;
  }
}

template <typename Raw>
void AttendHeads(const float* q, const void* keys, const void* values, const int32_t* limits, int64_t kv_heads,
                 int64_t groups, int64_t head_dim, int64_t slots, float scale, float* out, int64_t begin,
                 int64_t end) {
  const Raw* k = static_cast<const Raw*>(keys);
  const Raw* v = static_cast<const Raw*>(values);
  std::vector<float> scores(groups * slots);
  for (int64_t i = begin; i < end; ++i) {  // i = row * kv_heads + head
    const int64_t n = std::clamp<int64_t>(limits[i / kv_heads], 1, slots);
    AttendHead(q + i * groups * head_dim, k + i * head_dim * slots, v + i * slots * head_dim, groups, head_dim,
               slots, n, scale, scores.data(), out + i * groups * head_dim);
  }
}

// q [B, K, G, H] fp32; keys [B, K, H, T] and values [B, K, T, H], both fp32 or both bf16 bits (u16);
// limits [B]: row b attends over slots [0, limits[b]) (clamped to [1, T]); out [B, K, G, H] fp32.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                           ffi::Buffer<ffi::S32> limits, float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto key_dims = keys.dimensions(), value_dims = values.dimensions(), q_dims = q.dimensions();
  if (key_dims.size() != 4 || value_dims.size() != 4 || q_dims.size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q, keys and values must have rank 4");
  const int64_t rows = key_dims[0], kv_heads = key_dims[1], head_dim = key_dims[2], slots = key_dims[3];
  if (value_dims[0] != rows || value_dims[1] != kv_heads || value_dims[2] != slots || value_dims[3] != head_dim ||
      q_dims[0] != rows || q_dims[1] != kv_heads || q_dims[3] != head_dim || limits.element_count() != rows)
    return ffi::Error::InvalidArgument("decode_attention: keys [B,K,H,T], values [B,K,T,H], q [B,K,G,H], limits [B]");
  if (keys.element_type() != values.element_type() ||
      (keys.element_type() != ffi::F32 && keys.element_type() != ffi::U16))
    return ffi::Error::InvalidArgument("decode_attention: keys and values must both be f32 or both u16 (bf16 bits)");
  const int64_t groups = q_dims[2];
  const bool bits = keys.element_type() == ffi::U16;
  agentgym::Parallel(pool, rows * kv_heads, [&](int64_t begin, int64_t end) {
    (bits ? AttendHeads<uint16_t> : AttendHeads<float>)(q.typed_data(), keys.untyped_data(), values.untyped_data(),
                                                        limits.typed_data(), kv_heads, groups, head_dim, slots,
                                                        scale, out->typed_data(), begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
