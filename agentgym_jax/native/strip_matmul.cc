// A decode step's fp32 projections, y [M, N] = x [M, K] @ w with M <= 256 rows, on weights packed once per
// parameter update (agentgym_jax.prepacked) into 16-column strips (AVX-512 FMA; XLA FFI custom calls for XLA's
// CPU backend).
//
// At a few rows a projection only streams its weights, and XLA's CPU dots did not: the 210 fp32 projections of a
// SmolLM2-135M decode step (425 MB) took 40.7 ms at 8 rows (10.4 GB/s) and 60.8 ms at 32 (112 GFLOP/s) on a 2-core
// Xeon. Here w is laid out as strips [N/16, K, 16] (strip s holds columns 16s..16s+15, row after row), so a thread
// reads three strips as three sequential streams, keeps the outputs of up to 8 rows x 48 columns in 24 registers
// across all of K, and multiplies each loaded weight vector with every row (x's values broadcast from memory).
// More than 8 rows take further passes over the same three strips, which then come from L2 (a 64-row decode
// batch of SmolLM2-135M: 20% faster than XLA's dots). A tied output head w [N, K] is packed transposed into the
// same layout. Pure-JAX reference: the fp32 dot in
// agentgym_jax.mixed_matmul (tests/test_strip_matmul.py compares them).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "pass_rows.h"
#include "prefetch.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512F__
#error "strip_matmul needs AVX-512F (agentgym_jax.native_kernels only builds it where the CPU has it)"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16, kStripsPerPanel = 3, kRowsPerPass = 8, kMaxRows = 256;

// y[0:R, 16 S columns] for x's R rows (one pass of agentgym::PassRows' layout: x[k R + r]) against S strips starting at
// `strip` (stride k_size * 16).
template <int R, int S>
void Block(const float* x, int64_t k_size, const float* strip, float* y, int64_t n, const agentgym::Prefetch& next) {
  __m512 acc[R][S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    next.Step(k);
    __m512 w[S];
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) w[s] = _mm512_loadu_ps(strip + s * k_size * kLanes + k * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[k * R + r]);
#pragma GCC unroll 3
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(xr, w[s], acc[r][s]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(y + r * n + s * kLanes, acc[r][s]);
}

template <int S>
void Rows(int64_t rows, const float* x, int64_t k_size, const float* strip, float* y, int64_t n,
          const agentgym::Prefetch& next) {
  switch (rows) {
    case 1: return Block<1, S>(x, k_size, strip, y, n, next);
    case 2: return Block<2, S>(x, k_size, strip, y, n, next);
    case 3: return Block<3, S>(x, k_size, strip, y, n, next);
    case 4: return Block<4, S>(x, k_size, strip, y, n, next);
    case 5: return Block<5, S>(x, k_size, strip, y, n, next);
    case 6: return Block<6, S>(x, k_size, strip, y, n, next);
    case 7: return Block<7, S>(x, k_size, strip, y, n, next);
    default: return Block<8, S>(x, k_size, strip, y, n, next);
  }
}

// y[:, 48 p0 : 48 p1] (the last panel may hold fewer than 3 strips): each panel's strips against all of x's rows
// (interleaved: agentgym::PassRows), 8 rows per pass, each of several passes also bringing a share of the next panel
// into L2 (agentgym::Prefetch).
void Panels(const float* x, int64_t m, int64_t k_size, const float* packed, int64_t n, int64_t p0, int64_t p1,
            float* y) {
  const int64_t strips = n / kLanes, passes = (m + kRowsPerPass - 1) / kRowsPerPass;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t first = p * kStripsPerPanel, count = strips - first < kStripsPerPanel ? strips - first : 3;
    const float* strip = packed + first * k_size * kLanes;
    // the next panel, only where rows take several passes (at 8 rows and fewer the product streams its weights once,
    // and fetching ahead was no faster)
    const int64_t next_strips = p + 1 < p1 && passes > 1 ? std::min(kStripsPerPanel, strips - first - count) : 0;
    const int64_t next_bytes = next_strips * k_size * kLanes * int64_t{sizeof(float)};
    for (int64_t r = 0; r < m; r += kRowsPerPass) {
      const int64_t rows = m - r < kRowsPerPass ? m - r : kRowsPerPass;
      float* out = y + r * n + first * kLanes;
      const float* xr = x + r * k_size;  // pass r / 8 of the interleaved rows
      const auto next = agentgym::Prefetch::Share(strip + count * k_size * kLanes, next_bytes, r / kRowsPerPass,
                                                  passes, k_size);
      if (count == 3)
        Rows<3>(rows, xr, k_size, strip, out, n, next);
      else if (count == 2)
        Rows<2>(rows, xr, k_size, strip, out, n, next);
      else
        Rows<1>(rows, xr, k_size, strip, out, n, next);
    }
  }
}

ffi::Error StripMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kLanes || pd[1] != xd[1] || yd.size() != 2 || yd[0] != xd[0]
      || yd[1] != pd[0] * kLanes)
    return ffi::Error::InvalidArgument("strip_matmul: x [M, K], w packed [N/16, K, 16] and y [M, N] expected");
  const int64_t m = xd[0], k_size = xd[1], n = yd[1];
  if (m < 1 || m > kMaxRows) return ffi::Error::InvalidArgument("strip_matmul: needs 1 <= M <= 256");
  const int64_t panels = (n / kLanes + kStripsPerPanel - 1) / kStripsPerPanel;
  const std::vector<float> rows = agentgym::PassRows<float>(x.typed_data(), m, k_size, kRowsPerPass);
  const float* xp = rows.data();
  const float* wp = packed.typed_data();
  float* yp = y->typed_data();
  agentgym::Parallel(pool, panels, [&](int64_t begin, int64_t end) { Panels(xp, m, k_size, wp, n, begin, end, yp); });
  return ffi::Error::Success();
}

// Strips [begin, end) of w [K, N] packed: 16 rows of w at a time, each strip's part of them (16 rows of 16 lanes,
// 1 KB) written as one run, so the reads go along 16 rows at once and the writes in 1 KB runs.
void PackRows(const float* w, int64_t k_size, int64_t n, int64_t begin, int64_t end, float* out) {
  for (int64_t k0 = 0; k0 < k_size; k0 += kLanes) {
    const int64_t k1 = k0 + kLanes < k_size ? k0 + kLanes : k_size;
    for (int64_t s = begin; s < end; ++s)
      for (int64_t k = k0; k < k1; ++k)
        _mm512_storeu_ps(out + (s * k_size + k) * kLanes, _mm512_loadu_ps(w + k * n + s * kLanes));
  }
}

// dst[c * 16 + r] = src[r * stride + c] for a 16 x 16 block: 32-bit, then 64-bit interleaves within 128-bit lanes
// (each lane a 4 x 4 transpose), then two rounds of 128-bit lane shuffles across the four 4-row groups.
inline void Transpose16(const float* src, int64_t stride, float* dst) {
  __m512 r[16], a[16], b[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * stride);
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  const auto lo = [](__m512 x, __m512 y) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
  };
  const auto hi = [](__m512 x, __m512 y) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
  };
  for (int i = 0; i < 4; ++i) {  // b[4i + j], lane l: column 4l + j of rows 4i .. 4i + 3
    b[4 * i] = lo(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = hi(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = lo(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = hi(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 c0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xEE);
    const __m512 c2 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x44);
    const __m512 c3 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xEE);
    _mm512_storeu_ps(dst + (0 + j) * kLanes, _mm512_shuffle_f32x4(c0, c2, 0x88));
    _mm512_storeu_ps(dst + (4 + j) * kLanes, _mm512_shuffle_f32x4(c0, c2, 0xDD));
    _mm512_storeu_ps(dst + (8 + j) * kLanes, _mm512_shuffle_f32x4(c1, c3, 0x88));
    _mm512_storeu_ps(dst + (12 + j) * kLanes, _mm512_shuffle_f32x4(c1, c3, 0xDD));
  }
}

// Strips [begin, end) of a transposed w [N, K] packed: strip s is rows 16s .. 16s + 15 of w transposed, 16 x 16
// blocks at a time (rows read along, strips written in order); a K that is not a multiple of 16 ends in gathers.
void PackTransposed(const float* w, int64_t k_size, int64_t begin, int64_t end, float* out) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(k_size)));
  const int64_t whole = k_size / kLanes * kLanes;
  for (int64_t s = begin; s < end; ++s) {
    const float* block = w + s * kLanes * k_size;
    float* strip = out + s * k_size * kLanes;
    for (int64_t k0 = 0; k0 < whole; k0 += kLanes) Transpose16(block + k0, k_size, strip + k0 * kLanes);
    for (int64_t k = whole; k < k_size; ++k)
      _mm512_storeu_ps(strip + k * kLanes, _mm512_i32gather_ps(rows, block + k, 4));
  }
}

// packed [N/16, K, 16] from w [K, N] (transposed: w [N, K]); strip s, row k, lane c holds w[k, 16s + c]
// (transposed: w[16s + c, k]).
ffi::Error StripPack(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, bool transposed,
                     ffi::ResultBuffer<ffi::F32> packed) {
  const auto wd = w.dimensions(), pd = packed->dimensions();
  const int64_t k_size = wd.size() == 2 ? wd[transposed ? 1 : 0] : 0, n = wd.size() == 2 ? wd[transposed ? 0 : 1] : 0;
  if (wd.size() != 2 || n % kLanes || pd.size() != 3 || pd[0] * kLanes != n || pd[1] != k_size || pd[2] != kLanes)
    return ffi::Error::InvalidArgument(
        "strip_pack: w [K, N] (transposed: [N, K]) with N a multiple of 16 and packed [N/16, K, 16] expected");
  const float* wp = w.typed_data();
  float* out = packed->typed_data();
  agentgym::Parallel(pool, n / kLanes, [&](int64_t begin, int64_t end) {
    if (transposed)
      PackTransposed(wp, k_size, begin, end, out);
    else
      PackRows(wp, k_size, n, begin, end, out);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymStripMatmul, StripMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymStripPack, StripPack,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed").Ret<ffi::Buffer<ffi::F32>>());
