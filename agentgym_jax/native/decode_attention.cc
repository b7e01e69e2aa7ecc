// Decode-step attention over a KV cache, for XLA's CPU backend (an XLA FFI custom call).
//
// One query per row writes its new key and value into its row's cache and attends over the first limits[b] slots:
// keys [B, K, H, T] and values [B, K, T, H], fp32 or bf16 bits (uint16), the layouts of agentgym_jax.attention,
// updated in place (XLA aliases them to the outputs). XLA's own lowering of this step copied the bf16 cache out as
// fp32 for every layer and step, read every slot of the window, and scattered into the keys' strided layout; this
// writes the new entries in place, reads each cache entry once, widens it in registers, and stops at each row's own
// length. With AVX-512, a head's queries share each key and value vector loaded, their sums held in registers, and
// the next head's cache lines are asked for while this one computes. Pure-JAX reference:
// agentgym_jax.attention.write_slots then attend_one_query (tests/test_native_kernels.py compares them).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vector_math.h"
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
using agentgym::Exp16;
using agentgym::Lanes;
using agentgym::Load16;
#endif

// s[t] = exp(s[t] - max(s)) for t < n; returns their sum. The maximum is taken 16 lanes at a time: as a scalar
// loop it was a chain of n dependent comparisons, ~0.8k cycles a head at 232 slots and 3 queries (30 layers at
// batch 32: 0.47 -> 0.43 ms a layer).
inline float SoftmaxNumerators(float* s, int64_t n) {
  int64_t t = 0;
  float total = 0.0f;
#ifdef __AVX512F__
  __m512 tops = _mm512_set1_ps(s[0]);
  for (; t + 16 <= n; t += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(s + t));
  float top = _mm512_reduce_max_ps(tops);
  for (; t < n; ++t) top = std::max(top, s[t]);
  t = 0;
#else
  float top = s[0];
  for (int64_t u = 1; u < n; ++u) top = std::max(top, s[u]);
#endif
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

#ifdef __AVX512F__
// Walks a strided region (rows of `bytes` bytes, `stride` bytes apart) one cache line per step(), asking for each
// line ahead of use: the next head's keys and values are read while this head computes (their rows are short and
// far apart, so the hardware prefetchers start late and a core otherwise waits on each line). The lines go to L2,
// not L1: a head's keys and values (59 KB at 232 slots) do not fit L1 beside the next head's, and L1 prefetches
// held more of the core's few outstanding-miss slots (30 layers at batch 32: 0.53 -> 0.48 ms a layer).
struct Prefetcher {
  const char* base = nullptr;
  int64_t rows = 0, bytes = 0, stride = 0, row = 0, offset = 0;

  void step() {
    if (row >= rows) return;
    _mm_prefetch(base + row * stride + offset, _MM_HINT_T1);
    offset += 64;
    if (offset >= bytes) offset = 0, ++row;
  }
};

// Scores of `Queries` of a head's queries q [Queries, H] over slots [0, n) of keys [H, T], 32 slots at a time: one
// register per query and 16 slots, accumulated across the head dimension (each key vector loaded once for all the
// queries; 2 x Queries independent sums keep the FMA units busy). scores: [Queries, n].
template <int Queries, typename Raw>
void Scores(const float* q, const Raw* keys, int64_t head_dim, int64_t slots, int64_t n, float scale, float* scores,
            Prefetcher& ahead) {
  for (int64_t t = 0; t < n; t += 32) {
    const __mmask16 first = Lanes(n - t), second = Lanes(n - t - 16);
    __m512 acc[Queries][2];
    for (int g = 0; g < Queries; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t h = 0; h < head_dim; ++h) {
      ahead.step();
      const __m512 k0 = Load16(keys + h * slots + t, first), k1 = Load16(keys + h * slots + t + 16, second);
      for (int g = 0; g < Queries; ++g) {
        const __m512 qg = _mm512_set1_ps(q[g * head_dim + h]);
        acc[g][0] = _mm512_fmadd_ps(qg, k0, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(qg, k1, acc[g][1]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int g = 0; g < Queries; ++g) {
      _mm512_mask_storeu_ps(scores + g * n + t, first, _mm512_mul_ps(acc[g][0], s));
      _mm512_mask_storeu_ps(scores + g * n + t + 16, second, _mm512_mul_ps(acc[g][1], s));
    }
  }
}

// out [Queries, H] = weights [Queries, n] x values [n, H] / totals: each value row loaded once for the queries, the
// outputs' `Vectors` x 16 lanes per query held in registers across the slots.
template <int Vectors, int Queries, typename Raw>
void Mix(const float* weights, const Raw* values, int64_t head_dim, int64_t n, const float* totals, float* out,
         Prefetcher& ahead) {
  __m512 sum[Queries][Vectors];
  __mmask16 lanes[Vectors];
  for (int v = 0; v < Vectors; ++v) lanes[v] = Lanes(head_dim - 16 * v);
  for (int g = 0; g < Queries; ++g)
    for (int v = 0; v < Vectors; ++v) sum[g][v] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    ahead.step();
    ahead.step();
    __m512 row[Vectors];
    for (int v = 0; v < Vectors; ++v) row[v] = Load16(values + t * head_dim + 16 * v, lanes[v]);
    for (int g = 0; g < Queries; ++g) {
      const __m512 p = _mm512_set1_ps(weights[g * n + t]);
      for (int v = 0; v < Vectors; ++v) sum[g][v] = _mm512_fmadd_ps(p, row[v], sum[g][v]);
    }
  }
  for (int g = 0; g < Queries; ++g) {
    const __m512 inverse = _mm512_set1_ps(1.0f / totals[g]);
    for (int v = 0; v < Vectors; ++v)
      _mm512_mask_storeu_ps(out + g * head_dim + 16 * v, lanes[v], _mm512_mul_ps(sum[g][v], inverse));
  }
}

// One (row, kv head): its `groups` queries q [G, H] over keys [H, T] and values [T, H], slots [0, n), with
// head dims up to 16 x Vectors. scores: scratch of G * n floats; out: [G, H].
template <int Vectors, typename Raw>
void AttendHead(const float* q, const Raw* keys, const Raw* values, int64_t groups, int64_t head_dim,
                int64_t slots, int64_t n, float scale, float* scores, float* out, const Raw* next_keys,
                const Raw* next_values, int64_t next_n) {
  const int64_t size = sizeof(Raw);
  Prefetcher key_lines{reinterpret_cast<const char*>(next_keys), next_keys ? head_dim : 0, next_n * size, slots * size};
  Prefetcher value_lines{reinterpret_cast<const char*>(next_values), next_values ? 1 : 0, next_n * head_dim * size,
                         0};
  for (int64_t g = 0; g < groups; g += 4) {
    const float* qg = q + g * head_dim;
    float* sg = scores + g * n;
    switch (std::min<int64_t>(4, groups - g)) {
      case 1: Scores<1>(qg, keys, head_dim, slots, n, scale, sg, key_lines); break;
      case 2: Scores<2>(qg, keys, head_dim, slots, n, scale, sg, key_lines); break;
      case 3: Scores<3>(qg, keys, head_dim, slots, n, scale, sg, key_lines); break;
      default: Scores<4>(qg, keys, head_dim, slots, n, scale, sg, key_lines); break;
    }
  }
  // queries per pass over the values: up to 4, at most 16 output registers
  constexpr int kMix = Vectors <= 4 ? 4 : (Vectors <= 8 ? 2 : 1);
  float totals[kMix];
  for (int64_t g = 0; g < groups; g += kMix) {
    const int64_t count = std::min<int64_t>(kMix, groups - g);
    for (int64_t i = 0; i < count; ++i) totals[i] = SoftmaxNumerators(scores + (g + i) * n, n);
    const float* weights = scores + g * n;
    float* og = out + g * head_dim;
    switch (count) {
      case 1: Mix<Vectors, 1>(weights, values, head_dim, n, totals, og, value_lines); break;
      case 2: Mix<Vectors, (kMix >= 2 ? 2 : 1)>(weights, values, head_dim, n, totals, og, value_lines); break;
      case 3: Mix<Vectors, (kMix >= 3 ? 3 : 1)>(weights, values, head_dim, n, totals, og, value_lines); break;
      default: Mix<Vectors, kMix>(weights, values, head_dim, n, totals, og, value_lines); break;
    }
  }
}

template <typename Raw>
void AttendHeadAnyWidth(const float* q, const Raw* keys, const Raw* values, int64_t groups, int64_t head_dim,
                        int64_t slots, int64_t n, float scale, float* scores, float* out, const Raw* next_keys,
                        const Raw* next_values, int64_t next_n) {
  using Head = void (*)(const float*, const Raw*, const Raw*, int64_t, int64_t, int64_t, int64_t, float, float*,
                        float*, const Raw*, const Raw*, int64_t);
  // by 16-lane vectors per head dim, up to 256: the output stays in registers
  static constexpr Head kByVectors[] = {AttendHead<1, Raw>, AttendHead<2, Raw>, AttendHead<3, Raw>,
                                        AttendHead<4, Raw>, AttendHead<5, Raw>, AttendHead<6, Raw>,
                                        AttendHead<7, Raw>, AttendHead<8, Raw>, AttendHead<16, Raw>};
  const int64_t vectors = std::min<int64_t>((head_dim + 15) / 16, 9);
  kByVectors[vectors - 1](q, keys, values, groups, head_dim, slots, n, scale, scores, out, next_keys, next_values,
                          next_n);
}
#else
// One (row, kv head): its `groups` queries q [G, H] over keys [H, T] and values [T, H], slots [0, n).
// scores: scratch of n floats; out: [G, H].
template <typename Raw>
void AttendHeadAnyWidth(const float* q, const Raw* keys, const Raw* values, int64_t groups, int64_t head_dim,
                        int64_t slots, int64_t n, float scale, float* scores, float* out, const Raw* next_keys,
                        const Raw* next_values, int64_t next_n) {
  for (int64_t g = 0; g < groups; ++g) {
    std::fill(scores, scores + n, 0.0f);
    for (int64_t h = 0; h < head_dim; ++h) {
      const float qh = q[g * head_dim + h] * scale;
      for (int64_t t = 0; t < n; ++t) scores[t] += qh * Widen(keys[h * slots + t]);
    }
    const float inverse = 1.0f / SoftmaxNumerators(scores, n);
    float* o = out + g * head_dim;
    std::fill(o, o + head_dim, 0.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < head_dim; ++h) o[h] += scores[t] * Widen(values[t * head_dim + h]);
    for (int64_t h = 0; h < head_dim; ++h) o[h] *= inverse;
  }
}
#endif

// Writes each head's new key and value at slot limits[b] - 1 (none outside [0, T)), then attends.
template <typename Raw>
void WriteAndAttendHeads(const float* q, void* keys, void* values, const void* new_keys, const void* new_values,
                         const int32_t* limits, int64_t kv_heads, int64_t groups, int64_t head_dim, int64_t slots,
                         float scale, float* out, int64_t begin, int64_t end) {
  Raw* k = static_cast<Raw*>(keys);
  Raw* v = static_cast<Raw*>(values);
  const Raw* new_k = static_cast<const Raw*>(new_keys);
  const Raw* new_v = static_cast<const Raw*>(new_values);
  std::vector<float> scores(groups * slots);
  const auto length = [&](int64_t item) { return std::clamp<int64_t>(limits[item / kv_heads], 1, slots); };
  const auto write = [&](int64_t item) {  // keys [.., H, T]: one entry per row of H; values [.., T, H]: one row
    const int64_t slot = limits[item / kv_heads] - 1;
    if (slot < 0 || slot >= slots) return;
    for (int64_t h = 0; h < head_dim; ++h) k[(item * head_dim + h) * slots + slot] = new_k[item * head_dim + h];
    std::memcpy(v + (item * slots + slot) * head_dim, new_v + item * head_dim, head_dim * sizeof(Raw));
  };
  for (int64_t i = begin; i < end; ++i) {  // i = row * kv_heads + head
    // Each head's write goes just before its attention, into lines the previous head's pass has already asked for
    // (a write of one key touches one line per row of H: 64 lines). Writing every head of the chunk first made
    // each of those lines a separate miss (30 layers at batch 32: 11.9-13.5 -> 10.7-12.6 ms a step).
    write(i);
    const bool last = i + 1 == end;  // the next head's cache is read ahead while this one computes
    AttendHeadAnyWidth(q + i * groups * head_dim, k + i * head_dim * slots, v + i * slots * head_dim, groups,
                       head_dim, slots, length(i), scale, scores.data(), out + i * groups * head_dim,
                       last ? nullptr : k + (i + 1) * head_dim * slots, last ? nullptr : v + (i + 1) * slots * head_dim,
                       last ? 0 : length(i + 1));
  }
}

// q [B, K, G, H] fp32; keys [B, K, H, T] and values [B, K, T, H], both fp32 or both bf16 bits (u16), and the step's
// new_keys and new_values [B, K, H] of their type; limits [B]. Row b's new entries go to slot limits[b] - 1 (none
// outside [0, T)), in the cache buffers XLA aliases to the outputs, then it attends over slots [0, limits[b])
// (clamped to [1, T]); out [B, K, G, H] fp32. Writing here spares XLA's scatter into the keys' strided layout
// (44 us per layer at batch 8, 155 at batch 32: more than the attention over a short cache).
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                           ffi::AnyBuffer new_keys, ffi::AnyBuffer new_values, ffi::Buffer<ffi::S32> limits,
                           float scale, ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> keys_out,
                           ffi::Result<ffi::AnyBuffer> values_out) {
  const auto key_dims = keys.dimensions(), value_dims = values.dimensions(), q_dims = q.dimensions();
  if (key_dims.size() != 4 || value_dims.size() != 4 || q_dims.size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q, keys and values must have rank 4");
  const int64_t rows = key_dims[0], kv_heads = key_dims[1], head_dim = key_dims[2], slots = key_dims[3];
  if (value_dims[0] != rows || value_dims[1] != kv_heads || value_dims[2] != slots || value_dims[3] != head_dim ||
      q_dims[0] != rows || q_dims[1] != kv_heads || q_dims[3] != head_dim || limits.element_count() != rows ||
      new_keys.element_count() != rows * kv_heads * head_dim ||
      new_values.element_count() != rows * kv_heads * head_dim)
    return ffi::Error::InvalidArgument(
        "decode_attention: keys [B,K,H,T], values [B,K,T,H], q [B,K,G,H], new entries [B,K,H], limits [B]");
  const auto type = keys.element_type();
  if (values.element_type() != type || new_keys.element_type() != type || new_values.element_type() != type ||
      (type != ffi::F32 && type != ffi::U16))
    return ffi::Error::InvalidArgument(
        "decode_attention: caches and new entries must all be f32 or all u16 (bf16 bits)");
  if (head_dim > 256) return ffi::Error::InvalidArgument("decode_attention: head dims up to 256");
  if (keys_out->untyped_data() != keys.untyped_data())  // XLA aliases them; a copy keeps this correct otherwise
    std::memcpy(keys_out->untyped_data(), keys.untyped_data(), keys.size_bytes());
  if (values_out->untyped_data() != values.untyped_data())
    std::memcpy(values_out->untyped_data(), values.untyped_data(), values.size_bytes());
  const int64_t groups = q_dims[2];
  const bool bits = type == ffi::U16;
  agentgym::Parallel(pool, rows * kv_heads, [&](int64_t begin, int64_t end) {
    (bits ? WriteAndAttendHeads<uint16_t> : WriteAndAttendHeads<float>)(
        q.typed_data(), keys_out->untyped_data(), values_out->untyped_data(), new_keys.untyped_data(),
        new_values.untyped_data(), limits.typed_data(), kv_heads, groups, head_dim, slots, scale, out->typed_data(),
        begin, end);
  }, /*chunks_per_worker=*/4);  // heads take a few microseconds each; a chunk's first head starts cold
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
