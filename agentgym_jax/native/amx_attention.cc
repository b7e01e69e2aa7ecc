// Softmax attention of many queries (training rows, prompt prefill) on Intel AMX tiles, forward and backward (XLA
// FFI custom calls for XLA's CPU backend), for bf16 operands and a head dimension of 64.
//
// q [B, S, K, G, H] (K kv heads of G query heads each), keys [B, K, H, T], values [B, K, T, H] (the layouts of
// agentgym_jax.attention) and allowed [B, S, T]. XLA ran the per-kv-head products of attention.attend_in_blocks
// (64-deep contractions) and their fp32 softmax passes well below the machine: attention was a quarter of a bf16
// train step. Here each query head takes 16 queries at a time (32 in the backward pass): their scores against every
// key block they may read (blocks past the tile's last allowed key, or before its first, are skipped) go through
// the tiles into a row buffer that stays in L2, the softmax runs over it exactly (no running rescale), and the
// probabilities multiply the values back in the tiles. Operands that a tile product reads along its contraction
// are first packed into the tiles' pair layout (two bf16 of consecutive contraction index per fp32 lane), once per
// kv head. The backward pass is FlashAttention's: probabilities recomputed from the saved log-sum-exp, key and value
// gradients accumulated in fp32 per kv head. Pure-JAX reference: agentgym_jax.attention.attend_in_blocks
// (tests/test_amx_attention.py compares them); a row with no allowed key gets zeros here.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using agentgym::Exp16;
using agentgym::Lanes;
using agentgym::Load16;
using Bits = uint16_t;  // a bf16 number's bits

constexpr int64_t kHead = 64;  // head dimension: two 32-deep tile products per score, four 16-wide output tiles
constexpr int64_t kRows = 16;  // rows of a tile
constexpr int64_t kBlock = 32;  // keys per block: the depth of a probabilities x values product

struct Dims {
  int64_t batch, queries, kv_heads, groups, keys, padded_keys;  // padded_keys: keys rounded up to kBlock

  int64_t QueryOffset(int64_t b, int64_t s, int64_t k, int64_t g) const {  // element offset in q [B, S, K, G, H]
    return (((b * queries + s) * kv_heads + k) * groups + g) * kHead;
  }
  int64_t LseOffset(int64_t b, int64_t k, int64_t g) const { return ((b * kv_heads + k) * groups + g) * queries; }
};

// Every tile is 16 rows of 64 bytes: 16 x 32 bf16 operands and 16 x 16 fp32 products alike.
void ConfigureTiles() {
  agentgym::TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.Set(tile, kRows, 64);
  asm volatile("" ::: "memory");  // GCC does not see ldtilecfg read config: keep the stores above
  _tile_loadconfig(&config);
}

// dst[r][c] = (src[2r][c], src[2r + 1][c]) for a bf16 matrix src [rows, cols] (row stride `stride`), zero past its
// rows and columns: the pair layout of a tile operand read along src's rows. dst is [padded_rows / 2][padded_cols][2]
// and only columns [c0, c1) are written (multiples of 32).
void PackPairs(const Bits* src, int64_t rows, int64_t cols, int64_t stride, int64_t padded_rows, int64_t padded_cols,
               int64_t c0, int64_t c1, Bits* dst) {
  const agentgym::PairInterleave pairs;
  for (int64_t r = 0; r < padded_rows / 2; ++r)
    for (int64_t c = c0; c < c1; c += 32) {
      const int64_t left = cols - c;
      const __mmask32 lanes = left >= 32 ? ~__mmask32{0} : (left > 0 ? (__mmask32{1} << left) - 1 : 0);
      const __m512i even = 2 * r < rows ? _mm512_maskz_loadu_epi16(lanes, src + 2 * r * stride + c)
                                        : _mm512_setzero_si512();
      const __m512i odd = 2 * r + 1 < rows ? _mm512_maskz_loadu_epi16(lanes, src + (2 * r + 1) * stride + c)
                                           : _mm512_setzero_si512();
      Bits* out = dst + (r * padded_cols + c) * 2;
      _mm512_storeu_si512(out, pairs.Low(even, odd));
      _mm512_storeu_si512(out + 32, pairs.High(even, odd));
    }
}

// dst [cols][rows] = src [rows][cols] (row stride `stride`), bf16 bits.
void Transpose(const Bits* src, int64_t rows, int64_t cols, int64_t stride, Bits* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * stride + c];
}

// dst[c][r] = src[r][c] for a matrix of 32-bit elements src [rows, cols] (row stride src_stride), c < cols, r <
// dst_stride (a multiple of 16; zeros past `rows`), by gathers: a bf16 matrix packed in pairs transposes this way.
void Transpose32(const void* src_in, int64_t src_stride, int64_t rows, int64_t cols, void* dst_in,
                 int64_t dst_stride) {
  const auto* src = static_cast<const int*>(src_in);
  auto* dst = static_cast<int*>(dst_in);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t r0 = 0; r0 < dst_stride; r0 += 16) {
    const __mmask16 valid = Lanes(rows - r0);
    const __m512i index = _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(r0))),
                                             _mm512_set1_epi32(static_cast<int>(src_stride)));
    for (int64_t c = 0; c < cols; ++c)
      _mm512_storeu_si512(dst + c * dst_stride + r0,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, src + c, 4));
  }
}

inline void StoreBf16(Bits* dst, __m512 x) {  // 16 fp32 lanes rounded to bf16 (nearest even, as XLA's convert)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

inline __mmask16 AllowedLanes(const bool* allowed, int64_t t, int64_t keys) {  // allowed[t..t+16) as a mask
  return _mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8(Lanes(keys - t), allowed + t), _mm_setzero_si128());
}

// The keys that rows [s0, s0 + n) of one batch row's allowed [S, T] may read, as 32-aligned blocks [lo, hi); empty
// (lo == hi == 0) when none.
void KeyBlocks(const bool* allowed, int64_t keys, int64_t queries, int64_t s0, int64_t n, int64_t* lo,
               int64_t* hi) {
  int64_t first = keys, last = -1;
  for (int64_t s = s0; s < std::min(s0 + n, queries); ++s) {
    const bool* row = allowed + s * keys;
    if (first > 0) {
      const void* hit = std::memchr(row, 1, first);
      if (hit) first = static_cast<const bool*>(hit) - row;
    }
    if (last < keys - 1) {
      const void* hit = memrchr(row + last + 1, 1, keys - last - 1);
      if (hit) last = static_cast<const bool*>(hit) - row;
    }
  }
  if (last < 0) {
    *lo = *hi = 0;
    return;
  }
  *lo = first / kBlock * kBlock;
  *hi = (last + kBlock) / kBlock * kBlock;
}

// Scores [rows of `a`, keys] for one 16-row tile of queries (tiles 0 and 1: its two 32-wide halves of the head
// dimension, loaded by the caller) against keys packed in pairs [32][padded_keys][2], over blocks [lo, hi):
// written to scores (row stride padded_keys). Uses tiles 2, 3 and 4.
void TileScores(const Bits* packed_keys, int64_t padded_keys, int64_t lo, int64_t hi, float* scores) {
  asm volatile("" ::: "memory");  // GCC's tile loads do not order after plain stores: the packed operands first
  const int64_t stride = padded_keys * 4;
  const Bits* second_half = packed_keys + 16 * padded_keys * 2;
  for (int64_t t = lo; t < hi; t += kBlock) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, packed_keys + t * 2, stride);
    _tile_dpbf16ps(2, 0, 4);
    _tile_loadd(4, second_half + t * 2, stride);
    _tile_dpbf16ps(2, 1, 4);
    _tile_loadd(4, packed_keys + (t + 16) * 2, stride);
    _tile_dpbf16ps(3, 0, 4);
    _tile_loadd(4, second_half + (t + 16) * 2, stride);
    _tile_dpbf16ps(3, 1, 4);
    _tile_stored(2, scores + t, stride);
    _tile_stored(3, scores + t + 16, stride);
  }
}

// out [16, 64] fp32 = a [16, keys] (bf16, row stride padded_keys) x b, b packed in pairs along the keys
// [padded_keys / 2][64][2], over blocks [lo, hi). Uses tiles 2, 3, 4, 5, 6 and 7.
void TileTimesPacked(const Bits* a, const Bits* packed, int64_t padded_keys, int64_t lo, int64_t hi, float* out) {
  asm volatile("" ::: "memory");  // the operands' plain stores before the tile loads
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t t = lo; t < hi; t += kBlock) {
    const Bits* rows = packed + (t / 2) * kHead * 2;
    _tile_loadd(5, a + t, padded_keys * 2);
    _tile_loadd(4, rows, kHead * 4);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(4, rows + 32, kHead * 4);
    _tile_dpbf16ps(3, 5, 4);
    _tile_loadd(4, rows + 64, kHead * 4);
    _tile_dpbf16ps(6, 5, 4);
    _tile_loadd(4, rows + 96, kHead * 4);
    _tile_dpbf16ps(7, 5, 4);
  }
  _tile_stored(2, out, kHead * 4);
  _tile_stored(3, out + 16, kHead * 4);
  _tile_stored(6, out + 32, kHead * 4);
  _tile_stored(7, out + 48, kHead * 4);
  asm volatile("" ::: "memory");
}

// acc [64, padded_keys] fp32 += a^T-tile x packed, where a [64][32] (bf16: four 16-row tiles) holds a head-dim-major
// block of 32 queries and packed [16][padded_keys][2] the 32 queries' rows in pairs; over key blocks [lo, hi).
// Uses every tile.
void AccumulateTransposed(const Bits* a, const Bits* packed, int64_t padded_keys, int64_t lo, int64_t hi,
                          float* acc) {
  asm volatile("" ::: "memory");  // the operands' plain stores before the tile loads
  const int64_t stride = padded_keys * 4;
  _tile_loadd(0, a, 64);
  _tile_loadd(1, a + 16 * 32, 64);
  _tile_loadd(5, a + 32 * 32, 64);
  _tile_loadd(6, a + 48 * 32, 64);
  for (int64_t t = lo; t < hi; t += 16) {
    float* column = acc + t;
    _tile_loadd(4, packed + t * 2, stride);
    _tile_loadd(2, column, stride);
    _tile_loadd(3, column + 16 * padded_keys, stride);
    _tile_loadd(7, column + 32 * padded_keys, stride);
    _tile_dpbf16ps(2, 0, 4);
    _tile_dpbf16ps(3, 1, 4);
    _tile_dpbf16ps(7, 5, 4);
    _tile_stored(2, column, stride);
    _tile_stored(3, column + 16 * padded_keys, stride);
    _tile_stored(7, column + 32 * padded_keys, stride);
    _tile_loadd(2, column + 48 * padded_keys, stride);
    _tile_dpbf16ps(2, 6, 4);
    _tile_stored(2, column + 48 * padded_keys, stride);
  }
}

// One kv head's keys and values (bf16 bits) packed for the forward products.
struct PackedHead {
  std::vector<Bits> keys_t, values;  // [32][padded_keys][2] (pairs of the head dim), [padded_keys / 2][64][2]

  PackedHead(const Dims& d) : keys_t(32 * d.padded_keys * 2), values(d.padded_keys * kHead) {}
  void Pack(const Dims& d, const Bits* keys, const Bits* values_in) {  // keys [H, T], values [T, H]
    PackPairs(keys, kHead, d.keys, d.keys, kHead, d.padded_keys, 0, d.padded_keys, keys_t.data());
    PackPairs(values_in, d.keys, kHead, kHead, d.padded_keys, kHead, 0, kHead, values.data());
  }
};

// Whether q [B, S, K, G, 64], keys [B, K, 64, T], values [B, K, T, 64] and allowed [B, S, T] agree.
template <typename Dims4>
bool Consistent(const Dims4& q, const Dims4& k, const Dims4& v, const Dims4& a) {
  return q.size() == 5 && k.size() == 4 && v.size() == 4 && a.size() == 3 && q[4] == kHead && k[0] == q[0] &&
         k[1] == q[2] && k[2] == kHead && v[0] == q[0] && v[1] == q[2] && v[2] == k[3] && v[3] == kHead &&
         a[0] == q[0] && a[1] == q[1] && a[2] == k[3];
}

// ------------------------------------------------------------------------------------------------------ forward

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> keys,
                   ffi::Buffer<ffi::BF16> values, ffi::Buffer<ffi::PRED> allowed, float scale,
                   ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (!Consistent(qd, kd, values.dimensions(), allowed.dimensions()))
    return ffi::Error::InvalidArgument(
        "amx_attention: q [B, S, K, G, 64], keys [B, K, 64, T], values [B, K, T, 64] and allowed [B, S, T] expected");
  if (!agentgym::AmxGranted()) return ffi::Error::Internal("amx_attention: the OS did not grant AMX tiles");
  const int64_t t = kd[3];
  const Dims d{qd[0], qd[1], qd[2], qd[3], t, (t + kBlock - 1) / kBlock * kBlock};
  const auto* qp = reinterpret_cast<const Bits*>(q.untyped_data());
  const auto* kp = reinterpret_cast<const Bits*>(keys.untyped_data());
  const auto* vp = reinterpret_cast<const Bits*>(values.untyped_data());
  const bool* ap = allowed.typed_data();
  auto* op = reinterpret_cast<Bits*>(out->untyped_data());
  float* lp = lse->typed_data();
  agentgym::Parallel(pool, d.batch * d.kv_heads * d.groups, [&](int64_t begin, int64_t end) {
    ConfigureTiles();
    PackedHead head(d);
    std::vector<float> scores(kRows * d.padded_keys);
    std::vector<Bits> probs(kRows * d.padded_keys, 0);
    alignas(64) Bits query[kRows * kHead];
    alignas(64) float result[kRows * kHead];
    int64_t packed_for = -1;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (d.kv_heads * d.groups), k = unit / d.groups % d.kv_heads, g = unit % d.groups;
      if (packed_for != unit / d.groups) {
        packed_for = unit / d.groups;
        head.Pack(d, kp + (b * d.kv_heads + k) * kHead * t, vp + (b * d.kv_heads + k) * t * kHead);
      }
      const bool* row_allowed = ap + b * d.queries * t;
      for (int64_t s0 = 0; s0 < d.queries; s0 += kRows) {
        int64_t lo, hi;
        KeyBlocks(row_allowed, t, d.queries, s0, kRows, &lo, &hi);
        for (int64_t i = 0; i < kRows; ++i) {
          if (s0 + i < d.queries)
            std::memcpy(query + i * kHead, qp + d.QueryOffset(b, s0 + i, k, g), kHead * 2);
          else
            std::memset(query + i * kHead, 0, kHead * 2);
        }
        asm volatile("" ::: "memory");  // the copied queries before the tile loads
        _tile_loadd(0, query, kHead * 2);
        _tile_loadd(1, query + 32, kHead * 2);
        TileScores(head.keys_t.data(), d.padded_keys, lo, hi, scores.data());
        asm volatile("" ::: "memory");
        const __m512 scale16 = _mm512_set1_ps(scale);
        float normalizer[kRows];  // 1 / the softmax's denominator: the products use unnormalized numerators
        for (int64_t i = 0; i < kRows; ++i) {
          const int64_t s = s0 + i;
          const float* row = scores.data() + i * d.padded_keys;
          Bits* p = probs.data() + i * d.padded_keys;
          normalizer[i] = 0.0f;
          const bool* a = row_allowed + s * t;
          __m512 top16 = _mm512_set1_ps(-INFINITY);
          if (s < d.queries)
            for (int64_t j = lo; j < hi; j += 16)
              top16 = _mm512_mask_max_ps(top16, AllowedLanes(a, j, t), top16, _mm512_loadu_ps(row + j));
          const float top = _mm512_reduce_max_ps(top16) * scale;  // the largest scaled score
          if (top == -INFINITY) {  // a padding row, or no allowed key
            std::fill(p + lo, p + hi, 0);
            if (s < d.queries) lp[d.LseOffset(b, k, g) + s] = -INFINITY;
            continue;
          }
          __m512 sum = _mm512_setzero_ps();
          const __m512 shift = _mm512_set1_ps(top);
          for (int64_t j = lo; j < hi; j += 16) {
            const __m512 e = _mm512_maskz_mov_ps(AllowedLanes(a, j, t),
                                                 Exp16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), scale16, shift)));
            StoreBf16(p + j, e);
            sum = _mm512_add_ps(sum, e);
          }
          const float total = _mm512_reduce_add_ps(sum);
          normalizer[i] = 1.0f / total;
          lp[d.LseOffset(b, k, g) + s] = top + std::log(total);
        }
        TileTimesPacked(probs.data(), head.values.data(), d.padded_keys, lo, hi, result);
        for (int64_t i = 0; i < kRows && s0 + i < d.queries; ++i) {
          Bits* o = op + d.QueryOffset(b, s0 + i, k, g);
          const __m512 norm = _mm512_set1_ps(normalizer[i]);
          for (int64_t h = 0; h < kHead; h += 16)
            StoreBf16(o + h, _mm512_mul_ps(_mm512_loadu_ps(result + i * kHead + h), norm));
        }
      }
    }
    _tile_release();
  });
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------------------------------- backward

constexpr int64_t kQueryBlock = 32;  // queries per backward step: the depth of the key and value gradient products

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> keys,
                    ffi::Buffer<ffi::BF16> values, ffi::Buffer<ffi::PRED> allowed, ffi::Buffer<ffi::BF16> out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::BF16> d_out, float scale,
                    ffi::ResultBuffer<ffi::BF16> d_q, ffi::ResultBuffer<ffi::BF16> d_keys,
                    ffi::ResultBuffer<ffi::BF16> d_values) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (!Consistent(qd, kd, values.dimensions(), allowed.dimensions()))
    return ffi::Error::InvalidArgument(
        "amx_attention: q [B, S, K, G, 64], keys [B, K, 64, T], values [B, K, T, 64] and allowed [B, S, T] expected");
  const auto same = [&](auto dims) { return std::equal(dims.begin(), dims.end(), qd.begin(), qd.end()); };
  if (!same(out.dimensions()) || !same(d_out.dimensions()) || lse.dimensions().size() != 4 ||
      lse.element_count() != qd[0] * qd[2] * qd[3] * qd[1])
    return ffi::Error::InvalidArgument("amx_attention: out and d_out like q, lse [B, K, G, S] expected");
  if (!agentgym::AmxGranted()) return ffi::Error::Internal("amx_attention: the OS did not grant AMX tiles");
  const int64_t t = kd[3];
  const Dims d{qd[0], qd[1], qd[2], qd[3], t, (t + kBlock - 1) / kBlock * kBlock};
  const int64_t pk = d.padded_keys;
  const auto* qp = reinterpret_cast<const Bits*>(q.untyped_data());
  const auto* kp = reinterpret_cast<const Bits*>(keys.untyped_data());
  const auto* vp = reinterpret_cast<const Bits*>(values.untyped_data());
  const auto* outp = reinterpret_cast<const Bits*>(out.untyped_data());
  const auto* dop = reinterpret_cast<const Bits*>(d_out.untyped_data());
  const bool* ap = allowed.typed_data();
  const float* lp = lse.typed_data();
  auto* dqp = reinterpret_cast<Bits*>(d_q->untyped_data());
  auto* dkp = reinterpret_cast<Bits*>(d_keys->untyped_data());
  auto* dvp = reinterpret_cast<Bits*>(d_values->untyped_data());
  agentgym::Parallel(pool, d.batch * d.kv_heads, [&](int64_t begin, int64_t end) {
    ConfigureTiles();
    std::vector<Bits> keys_t_pairs(32 * pk * 2);  // K^T in pairs of the head dim (the scores)
    std::vector<Bits> keys_rows(t % 2 ? t * kHead : 0);  // K [T, 64], for an odd T
    std::vector<Bits> values_t_pairs(32 * pk * 2), keys_pairs(pk * kHead);
    std::vector<float> probs(kQueryBlock * pk), d_probs(kQueryBlock * pk);
    std::vector<Bits> probs_bf16(kQueryBlock * pk, 0), d_scores(kQueryBlock * pk, 0);
    std::vector<Bits> probs_pairs(16 * pk * 2), d_scores_pairs(16 * pk * 2);
    std::vector<float> d_keys_t(kHead * pk), d_values_t(kHead * pk);  // [64][padded keys] fp32 accumulators
    alignas(64) Bits query[kQueryBlock * kHead], grad[kQueryBlock * kHead];
    alignas(64) Bits query_t[kHead * kQueryBlock], grad_t[kHead * kQueryBlock], row_pairs[kQueryBlock * kHead];
    std::vector<float> d_values(t * kHead);
    alignas(64) float result[kRows * kHead];
    float delta[kQueryBlock];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / d.kv_heads, k = unit % d.kv_heads;
      const Bits* keys_t = kp + unit * kHead * t;  // [64, T]
      const Bits* values_in = vp + unit * t * kHead;  // [T, 64]
      PackPairs(keys_t, kHead, t, t, kHead, pk, 0, pk, keys_t_pairs.data());
      // V^T in pairs of the head dim: V's rows read as 32 pairs each, transposed
      Transpose32(values_in, kHead / 2, t, kHead / 2, values_t_pairs.data(), pk);
      if (t % 2 == 0) {  // K in pairs of keys: K^T's rows read as pairs of keys, transposed
        std::fill(keys_pairs.begin() + t * kHead, keys_pairs.end(), 0);
        Transpose32(keys_t, t / 2, kHead, t / 2, keys_pairs.data(), kHead);
      } else {
        Transpose(keys_t, kHead, t, t, keys_rows.data());
        PackPairs(keys_rows.data(), t, kHead, kHead, pk, kHead, 0, kHead, keys_pairs.data());
      }
      std::fill(d_keys_t.begin(), d_keys_t.end(), 0.0f);
      std::fill(d_values_t.begin(), d_values_t.end(), 0.0f);
      const bool* row_allowed = ap + b * d.queries * t;
      for (int64_t g = 0; g < d.groups; ++g)
        for (int64_t s0 = 0; s0 < d.queries; s0 += kQueryBlock) {
          int64_t lo, hi;
          KeyBlocks(row_allowed, t, d.queries, s0, kQueryBlock, &lo, &hi);
          if (lo >= hi) {  // no query of the block reads a key: no gradient
            for (int64_t s = s0; s < std::min(s0 + kQueryBlock, d.queries); ++s)
              std::memset(dqp + d.QueryOffset(b, s, k, g), 0, kHead * 2);
            continue;
          }
          for (int64_t i = 0; i < kQueryBlock; ++i) {
            const int64_t s = s0 + i;
            delta[i] = 0.0f;
            if (s >= d.queries) {
              std::memset(query + i * kHead, 0, kHead * 2);
              std::memset(grad + i * kHead, 0, kHead * 2);
              continue;
            }
            const int64_t at = d.QueryOffset(b, s, k, g);
            std::memcpy(query + i * kHead, qp + at, kHead * 2);
            std::memcpy(grad + i * kHead, dop + at, kHead * 2);
            __m512 sum = _mm512_setzero_ps();  // D = sum_h dO * O: the softmax gradient's per-query term
            for (int64_t h = 0; h < kHead; h += 16)
              sum = _mm512_fmadd_ps(Load16(dop + at + h, 0xFFFF), Load16(outp + at + h, 0xFFFF), sum);
            delta[i] = _mm512_reduce_add_ps(sum);
          }
          for (auto [rows, rows_t] : {std::pair{query, query_t}, std::pair{grad, grad_t}}) {  // [32, 64] -> [64, 32]
            PackPairs(rows, kQueryBlock, kHead, kHead, kQueryBlock, kHead, 0, kHead, row_pairs);
            Transpose32(row_pairs, kHead, kQueryBlock / 2, kHead, rows_t, kQueryBlock / 2);
          }
          asm volatile("" ::: "memory");  // the copied queries and output gradients before the tile loads
          for (int64_t half = 0; half < 2; ++half) {  // scores and dP = dO V^T, 16 queries at a time
            const int64_t row0 = half * kRows;
            _tile_loadd(0, query + row0 * kHead, kHead * 2);
            _tile_loadd(1, query + row0 * kHead + 32, kHead * 2);
            TileScores(keys_t_pairs.data(), pk, lo, hi, probs.data() + row0 * pk);
            _tile_loadd(0, grad + row0 * kHead, kHead * 2);
            _tile_loadd(1, grad + row0 * kHead + 32, kHead * 2);
            TileScores(values_t_pairs.data(), pk, lo, hi, d_probs.data() + row0 * pk);
          }
          asm volatile("" ::: "memory");
          const __m512 scale16 = _mm512_set1_ps(scale);
          for (int64_t i = 0; i < kQueryBlock; ++i) {  // P, and dS = P (dP - D) scale
            const int64_t s = s0 + i;
            float* p = probs.data() + i * pk;
            const float* dp = d_probs.data() + i * pk;
            Bits* p16 = probs_bf16.data() + i * pk;
            Bits* ds16 = d_scores.data() + i * pk;
            if (s >= d.queries) {
              std::fill(p16 + lo, p16 + hi, 0);
              std::fill(ds16 + lo, ds16 + hi, 0);
              continue;
            }
            const bool* a = row_allowed + s * t;
            const float row_lse = lp[d.LseOffset(b, k, g) + s];
            const __m512 shift = _mm512_set1_ps(row_lse), delta16 = _mm512_set1_ps(delta[i]);
            for (int64_t j = lo; j < hi; j += 16) {
              const __mmask16 lanes = row_lse == -INFINITY ? 0 : AllowedLanes(a, j, t);
              const __m512 prob = _mm512_maskz_mov_ps(lanes, Exp16(_mm512_fmsub_ps(_mm512_loadu_ps(p + j), scale16,
                                                                                shift)));
              StoreBf16(p16 + j, prob);
              const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(prob, _mm512_sub_ps(_mm512_loadu_ps(dp + j), delta16)),
                                              scale16);
              StoreBf16(ds16 + j, ds);
            }
          }
          for (int64_t half = 0; half < 2; ++half) {  // dQ = dS K
            const int64_t row0 = half * kRows;
            TileTimesPacked(d_scores.data() + row0 * pk, keys_pairs.data(), pk, lo, hi, result);
            for (int64_t i = 0; i < kRows && s0 + row0 + i < d.queries; ++i) {
              Bits* o = dqp + d.QueryOffset(b, s0 + row0 + i, k, g);
              for (int64_t h = 0; h < kHead; h += 16) StoreBf16(o + h, _mm512_loadu_ps(result + i * kHead + h));
            }
          }
          // dV^T += dO^T P and dK^T += Q^T dS, contracting over the block's 32 queries
          PackPairs(probs_bf16.data(), kQueryBlock, pk, pk, kQueryBlock, pk, lo, hi, probs_pairs.data());
          PackPairs(d_scores.data(), kQueryBlock, pk, pk, kQueryBlock, pk, lo, hi, d_scores_pairs.data());
          AccumulateTransposed(grad_t, probs_pairs.data(), pk, lo, hi, d_values_t.data());
          AccumulateTransposed(query_t, d_scores_pairs.data(), pk, lo, hi, d_keys_t.data());
        }
      asm volatile("" ::: "memory");
      Bits* dk = dkp + unit * kHead * t;  // [64, T]
      Bits* dv = dvp + unit * t * kHead;  // [T, 64]
      for (int64_t h = 0; h < kHead; ++h) {
        for (int64_t j = 0; j < t; j += 16) {
          const __mmask16 lanes = Lanes(t - j);
          const __m256i bits =
              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(d_keys_t.data() + h * pk + j)));
          _mm256_mask_storeu_epi16(dk + h * t + j, lanes, bits);
        }
      }
      Transpose32(d_values_t.data(), pk, kHead, t, d_values.data(), kHead);
      for (int64_t j = 0; j < t * kHead; j += 16) StoreBf16(dv + j, _mm512_loadu_ps(d_values.data() + j));
    }
    _tile_release();
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxAttentionForward, Forward,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>().Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxAttentionBackward, Backward,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::BF16>>().Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
