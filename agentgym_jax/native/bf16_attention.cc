// Softmax attention of many queries (a prompt's prefill) with AVX512-BF16 dot products, forward only, on CPUs
// without AMX (XLA FFI custom call for XLA's CPU backend): bf16 operands, a head dimension that is a multiple of 32.
//
// q [B, S, K, G, H] (K kv heads of G query heads each), keys [B, K, H, T], values [B, K, T, H] (the layouts of
// agentgym_jax.attention) and allowed [B, S, T]. XLA ran a 128-token chunk's attention as batched dots of fp32
// scores [B, K, G x S, T] and separate softmax passes, at ~50 GFLOP/s on a 2-core EPYC, a fifth of a batch-32
// prefill. Here each thread takes one (row, kv head) at a time: its keys and values go into pair rows once (keys
// [H/2][T][2], values [T/2][H][2]), then 8 queries at a time get their scores against the key blocks they may read
// (up to the last key any of the 8 may attend to) in registers, an exact softmax over them in an L1 buffer, and
// the bf16 unnormalized exponentials times the values, each output divided by the fp32 sum of its exponentials (as
// native/amx_attention.cc does). Pure-JAX reference: agentgym_jax.attention.attend (tests/test_bf16_attention.py
// compares them); a query with no allowed key gets zeros.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_pairs.h"
#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512BF16__
#error "bf16_attention needs AVX512-BF16 (agentgym_jax.native_kernels only builds it where the CPU has it)"
#endif

namespace ffi = xla::ffi;

namespace {

using agentgym::BroadcastPair;
using agentgym::LoadPairs;
using Bits = uint16_t;  // a bf16 number's bits

constexpr int64_t kLanes = 16, kRows = 8, kKeyBlock = 32;  // keys per score block: two vectors

struct Dims {
  int64_t batch, queries, kv_heads, groups, head, keys;
  int64_t padded() const { return (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock; }
  int64_t QueryOffset(int64_t b, int64_t s, int64_t k, int64_t g) const {  // element offset in q [B, S, K, G, H]
    return (((b * queries + s) * kv_heads + k) * groups + g) * head;
  }
};

// One past the last key that any of queries [s0, s1) of row b may attend to (0: none). Each query's row of the
// mask is searched past the end found so far with memrchr (vectorized in glibc): a byte-at-a-time backward scan was
// a fifth of this kernel's time in a batch-32 prefill.
int64_t KeyEnd(const bool* allowed, const Dims& d, int64_t b, int64_t s0, int64_t s1) {
  int64_t end = 0;
  for (int64_t s = s0; s < s1 && end < d.keys; ++s) {
    const bool* row = allowed + (b * d.queries + s) * d.keys;
    if (const void* hit = memrchr(row + end, 1, d.keys - end)) end = static_cast<const bool*>(hit) - row + 1;
  }
  return end;
}

// keys [H, T] of one kv head as pair rows [H/2][padded][2]; values [T, H] as [padded/2][H][2]; zeros past T.
void PackHead(const Bits* keys, const Bits* values, const Dims& d, int64_t end, Bits* key_pairs, Bits* value_pairs) {
  const int64_t padded = (end + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  for (int64_t j = 0; j < d.head / 2; ++j)
    for (int64_t t = 0; t < padded; t += kLanes) {
      const Bits* even = keys + 2 * j * d.keys + t;
      _mm512_storeu_si512(key_pairs + (j * padded + t) * 2,
                          agentgym::InterleavePairs(even, even + d.keys, agentgym::Lanes(d.keys - t)));
    }
  const auto row = [&](int64_t t, int64_t h) {  // 16 numbers of value row t (zeros for a row past T)
    return t < d.keys ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + t * d.head + h))
                      : _mm256_setzero_si256();
  };
  for (int64_t tp = 0; tp < padded / 2; ++tp)
    for (int64_t h = 0; h < d.head; h += kLanes)
      _mm512_storeu_si512(value_pairs + (tp * d.head + h) * 2,
                          agentgym::InterleavePairs(row(2 * tp, h), row(2 * tp + 1, h)));
}

// scores[r][0:end) for R queries (bf16 rows of H at q[r * stride]) against the key pairs [H/2][padded][2].
template <int R>
void Scores(const Bits* q, int64_t stride, const Bits* key_pairs, int64_t head, int64_t padded, int64_t end,
            float* scores) {
  for (int64_t t = 0; t < end; t += kKeyBlock) {
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < head / 2; ++j) {
      const __m512bh k0 = LoadPairs(key_pairs + (j * padded + t) * 2), k1 = LoadPairs(key_pairs + (j * padded + t + kLanes) * 2);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh x = BroadcastPair(q + r * stride + 2 * j);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, k1);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(scores + r * padded + t, acc[r][0]);
      _mm512_storeu_ps(scores + r * padded + t + kLanes, acc[r][1]);
    }
  }
}

// The row's exponentials e^(scale x - max) of its allowed scores as bf16 (zeros elsewhere, up to the next whole key
// block) into probs; returns their fp32 sum (0: no allowed key).
float Softmax(const float* scores, const bool* allowed, int64_t keys, int64_t end, float scale, Bits* probs) {
  const auto mask = [&](int64_t t) {
    return _mm_mask_cmpneq_epi8_mask(agentgym::Lanes(keys - t), _mm_maskz_loadu_epi8(agentgym::Lanes(keys - t), allowed + t),
                                     _mm_setzero_si128());
  };
  const __m512 scale16 = _mm512_set1_ps(scale);
  __m512 high = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < end; t += kLanes)
    high = _mm512_mask_max_ps(high, mask(t), high, _mm512_mul_ps(_mm512_loadu_ps(scores + t), scale16));
  const float top = _mm512_reduce_max_ps(high);
  const int64_t padded = (end + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(probs, probs + padded, Bits{0});
    return 0.0f;
  }
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t t = 0; t < padded; t += kLanes) {
    const __m512 e = _mm512_maskz_mov_ps(
        t < end ? mask(t) : 0, agentgym::Exp16(_mm512_fmsub_ps(_mm512_loadu_ps(scores + t), scale16, shift)));
    const __m256i bits = agentgym::RoundToBf16(e);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t), bits);
  }
  return _mm512_reduce_add_ps(sum);
}

// out rows (bf16, stride `stride`) = probs [R][padded] (bf16) x value pairs [padded/2][H][2], each divided by its sum.
template <int R>
void Weighted(const Bits* probs, int64_t padded, const Bits* value_pairs, int64_t head, int64_t end,
              const float* sums, Bits* out, int64_t stride) {
  for (int64_t h = 0; h < head; h += 2 * kLanes) {
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t tp = 0; tp < (end + 1) / 2; ++tp) {
      const __m512bh v0 = LoadPairs(value_pairs + (tp * head + h) * 2);
      const __m512bh v1 = LoadPairs(value_pairs + (tp * head + h + kLanes) * 2);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh p = BroadcastPair(probs + r * padded + 2 * tp);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], p, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], p, v1);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 inverse = _mm512_set1_ps(sums[r] > 0 ? 1.0f / sums[r] : 0.0f);
      for (int half = 0; half < 2; ++half)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * stride + h + half * kLanes),
                            agentgym::RoundToBf16(_mm512_mul_ps(acc[r][half], inverse)));
    }
  }
}

template <int R>
void Queries(const Bits* q, const bool* allowed, const Dims& d, int64_t b, int64_t k, int64_t g, int64_t s0,
             const Bits* key_pairs, const Bits* value_pairs, int64_t padded, float scale, float* scores, Bits* probs,
             Bits* out) {
  const int64_t end = KeyEnd(allowed, d, b, s0, s0 + R);
  const int64_t stride = d.kv_heads * d.groups * d.head;  // from one query to the next in q and out
  const Bits* first = q + d.QueryOffset(b, s0, k, g);
  Bits* out_first = out + d.QueryOffset(b, s0, k, g);
  float sums[R];
  if (end) Scores<R>(first, stride, key_pairs, d.head, padded, end, scores);
  for (int r = 0; r < R; ++r)
    sums[r] = end ? Softmax(scores + r * padded, allowed + (b * d.queries + s0 + r) * d.keys, d.keys, end, scale,
                            probs + r * padded)
                  : 0.0f;
  if (end) {
    Weighted<R>(probs, padded, value_pairs, d.head, end, sums, out_first, stride);
  } else {
    for (int r = 0; r < R; ++r) std::fill(out_first + r * stride, out_first + r * stride + d.head, Bits{0});
  }
}

ffi::Error Bf16Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> keys,
                         ffi::Buffer<ffi::BF16> values, ffi::Buffer<ffi::PRED> allowed, float scale,
                         ffi::ResultBuffer<ffi::BF16> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), ad = allowed.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || ad.size() != 3)
    return ffi::Error::InvalidArgument("bf16_attention: q [B, S, K, G, H], keys [B, K, H, T], values [B, K, T, H], "
                                       "allowed [B, S, T] expected");
  const Dims d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[3]};
  if (kd[0] != d.batch || kd[1] != d.kv_heads || kd[2] != d.head || vd[0] != d.batch || vd[1] != d.kv_heads
      || vd[2] != d.keys || vd[3] != d.head || ad[0] != d.batch || ad[1] != d.queries || ad[2] != d.keys)
    return ffi::Error::InvalidArgument("bf16_attention: the shapes of q, keys, values and allowed disagree");
  if (d.head % (2 * kLanes)) return ffi::Error::InvalidArgument("bf16_attention: H must be a multiple of 32");
  const auto* qp = reinterpret_cast<const Bits*>(q.untyped_data());
  const auto* kp = reinterpret_cast<const Bits*>(keys.untyped_data());
  const auto* vp = reinterpret_cast<const Bits*>(values.untyped_data());
  const bool* ap = allowed.typed_data();
  auto* op = reinterpret_cast<Bits*>(out->untyped_data());
  agentgym::Parallel(pool, d.batch * d.kv_heads, [&](int64_t begin, int64_t end_item) {
    std::vector<Bits> key_pairs(d.head * d.padded()), value_pairs(d.head * d.padded()), probs(kRows * d.padded());
    std::vector<float> scores(kRows * d.padded());
    for (int64_t item = begin; item < end_item; ++item) {
      const int64_t b = item / d.kv_heads, k = item % d.kv_heads;
      const int64_t end = KeyEnd(ap, d, b, 0, d.queries);
      const int64_t padded = (end + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      if (end)
        PackHead(kp + (b * d.kv_heads + k) * d.head * d.keys, vp + (b * d.kv_heads + k) * d.keys * d.head, d, end,
                 key_pairs.data(), value_pairs.data());
      for (int64_t g = 0; g < d.groups; ++g)
        for (int64_t s0 = 0; s0 < d.queries; s0 += kRows) {
          const auto run = [&](auto rows) {
            Queries<decltype(rows)::value>(qp, ap, d, b, k, g, s0, key_pairs.data(), value_pairs.data(), padded,
                                           scale, scores.data(), probs.data(), op);
          };
          switch (std::min(kRows, d.queries - s0)) {
            case 1: run(std::integral_constant<int, 1>()); break;
            case 2: run(std::integral_constant<int, 2>()); break;
            case 3: run(std::integral_constant<int, 3>()); break;
            case 4: run(std::integral_constant<int, 4>()); break;
            case 5: run(std::integral_constant<int, 5>()); break;
            case 6: run(std::integral_constant<int, 6>()); break;
            case 7: run(std::integral_constant<int, 7>()); break;
            default: run(std::integral_constant<int, 8>());
          }
        }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymBf16Attention, Bf16Attention,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>().Attr<float>("scale").Ret<ffi::Buffer<ffi::BF16>>());
