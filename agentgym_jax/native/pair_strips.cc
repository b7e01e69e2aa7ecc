// bf16 weights packed into strips of pair rows [N/16, K/2, 16, 2] once per parameter update (Bf16StripPack: every
// bf16 strip product reads this layout), and products on them with fp32 FMAs for CPUs with AVX-512 but no AVX512-BF16
// dot products (Skylake-SP to Ice Lake servers); XLA FFI custom calls for XLA's CPU backend.
//
// There XLA's CPU backend runs a bf16 dot by converting both operands to fp32 and multiplying those, below the rate
// of its fp32 dots, and a decode step of bf16 weights took twice the fp32 step (a 2-core Ice Lake Xeon, batch 8: 60
// against 33 ms). Here a product reads w's bf16 numbers (half the bytes of fp32 weights) and widens each 64-byte pair
// row in registers: a 32-bit lane holds w[2kp, c] in its low and w[2kp + 1, c] in its high half, so w[2kp + 1, c] is
// the lane with its low half cleared and w[2kp, c] the lane shifted left by 16 (bf16 is fp32's upper half). x is
// widened once per call into agentgym::PassRows' layout (agentgym::WidenPasses). Each 8 rows x 3 strips block keeps its 24 sums in
// registers across all of K and multiplies each widened weight vector with every row, in the order k = 0, 1, 2, ...:
// the sums of an fp32 dot of the widened operands, up to the FMAs' rounding. Decode-sized products (at most 64 rows)
// go panel by panel, fetching the next panel into L2 during the current one's passes; a prefill's products of many
// rows go through groups of panels that stay in L2 while 8 rows of x at a time, read from L1, pass over the group.
// Pure-JAX reference: the bf16 dot in agentgym_jax.mixed_matmul (tests/test_pair_strips.py compares them).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "bf16_pairs.h"
#include "parallel.h"
#include "pass_rows.h"
#include "prefetch.h"
#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "pair_strips needs AVX-512F and AVX-512BW (agentgym_jax.native_kernels only builds it where the CPU has them)"
#endif

namespace ffi = xla::ffi;
using agentgym::Prefetch;

namespace {

constexpr int64_t kLanes = 16, kStripsPerPanel = 3, kRowsPerPass = 8;
constexpr int64_t kGroupBytes = 512 << 10;  // a prefill's group of panels (bf16), held in L2 while x passes over it
constexpr int64_t kMaxDecodeRows = 64;       // more rows take the grouped loop

// y[0:R, 16 S columns] (row stride n) for one pass of x's R rows widened to fp32 (x[k R + r]) against S strips of pair
// rows starting at `strip` (stride k_size * 16 bf16 numbers).
template <int R, int S, bool kPrefetch>
void Block(const float* x, int64_t k_size, const uint16_t* strip, float* y, int64_t n, const Prefetch& next) {
  __m512 acc[R][S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    if constexpr (kPrefetch) next.Step(kp);
    const uint16_t* pairs = strip + kp * 2 * kLanes;
    __m512 w[S];
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s)  // w[2kp, :]: each lane's low half moved up
      w[s] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(pairs + s * k_size * kLanes), 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[2 * kp * R + r]);
#pragma GCC unroll 3
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(xr, w[s], acc[r][s]);
    }
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s)  // w[2kp + 1, :]: each lane with its low half cleared
      w[s] = _mm512_castsi512_ps(_mm512_maskz_mov_epi16(0xAAAAAAAA, _mm512_loadu_si512(pairs + s * k_size * kLanes)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[(2 * kp + 1) * R + r]);
#pragma GCC unroll 3
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(xr, w[s], acc[r][s]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(y + r * n + s * kLanes, acc[r][s]);
}

template <int S, bool kPrefetch>
void Rows(int64_t rows, const float* x, int64_t k_size, const uint16_t* strip, float* y, int64_t n,
          const Prefetch& next) {
  switch (rows) {
    case 1: return Block<1, S, kPrefetch>(x, k_size, strip, y, n, next);
    case 2: return Block<2, S, kPrefetch>(x, k_size, strip, y, n, next);
    case 3: return Block<3, S, kPrefetch>(x, k_size, strip, y, n, next);
    case 4: return Block<4, S, kPrefetch>(x, k_size, strip, y, n, next);
    case 5: return Block<5, S, kPrefetch>(x, k_size, strip, y, n, next);
    case 6: return Block<6, S, kPrefetch>(x, k_size, strip, y, n, next);
    case 7: return Block<7, S, kPrefetch>(x, k_size, strip, y, n, next);
    default: return Block<8, S, kPrefetch>(x, k_size, strip, y, n, next);
  }
}

// One pass (rows at most 8, x at its first row) over panel p's strips (the last panel may hold fewer than 3).
void Pass(int64_t rows, const float* x, int64_t k_size, const uint16_t* packed, int64_t strips, int64_t p, float* y,
          int64_t n, const Prefetch& next = {}) {
  const int64_t first = p * kStripsPerPanel, count = std::min(kStripsPerPanel, strips - first);
  const uint16_t* strip = packed + first * k_size * kLanes;
  float* out = y + first * kLanes;
  const auto rows_of = [&](auto strips_constant) {
    constexpr int kStrips = decltype(strips_constant)::value;
    if (next.count)
      Rows<kStrips, true>(rows, x, k_size, strip, out, n, next);
    else
      Rows<kStrips, false>(rows, x, k_size, strip, out, n, next);
  };
  if (count == 3)
    rows_of(std::integral_constant<int, 3>{});
  else if (count == 2)
    rows_of(std::integral_constant<int, 2>{});
  else
    rows_of(std::integral_constant<int, 1>{});
}

// y[:, 48 p0 : 48 p1] for all m rows of x (widened, in agentgym::PassRows' layout, 8 rows a pass).
void Panels(const float* x, int64_t m, int64_t k_size, const uint16_t* packed, int64_t strips, int64_t p0, int64_t p1,
            float* y) {
  const int64_t n = strips * kLanes, passes = (m + kRowsPerPass - 1) / kRowsPerPass;
  const auto rows = [&](int64_t r) { return std::min(kRowsPerPass, m - r); };
  if (m > kMaxDecodeRows) {  // a prefill: groups of panels held in L2, each pass of x over the whole group
    const int64_t panel_bytes = kStripsPerPanel * k_size * kLanes * int64_t{sizeof(uint16_t)};
    const int64_t group = std::max<int64_t>(1, kGroupBytes / panel_bytes);
    for (int64_t g0 = p0; g0 < p1; g0 += group)
      for (int64_t r = 0; r < m; r += kRowsPerPass)
        for (int64_t p = g0; p < std::min(p1, g0 + group); ++p)
          Pass(rows(r), x + r * k_size, k_size, packed, strips, p, y + r * n, n);
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    // the thread's next panel (its strips follow this one's), a share of it during each pass; not below 8 rows,
    // where a product only streams its weights once
    const int64_t next_first = (p + 1) * kStripsPerPanel;
    const int64_t next_strips = p + 1 < p1 && passes > 1 ? std::min(kStripsPerPanel, strips - next_first) : 0;
    const uint16_t* next = packed + next_first * k_size * kLanes;
    const int64_t next_bytes = next_strips * k_size * kLanes * int64_t{sizeof(uint16_t)};
    for (int64_t r = 0; r < m; r += kRowsPerPass)
      Pass(rows(r), x + r * k_size, k_size, packed, strips, p, y + r * n, n,
           Prefetch::Share(next, next_bytes, r / kRowsPerPass, passes, k_size / 2));
  }
}

const uint16_t* Bits(const ffi::Buffer<ffi::BF16>& buffer) {  // a bf16 buffer's numbers as their bits
  return reinterpret_cast<const uint16_t*>(buffer.untyped_data());
}

// y [M, N] fp32 = x [M, K] @ w for bf16 x and w packed by Bf16StripPack [N/16, K/2, 16, 2], any M.
ffi::Error WidenedStripMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || pd[2] != kLanes || pd[3] != 2 || 2 * pd[1] != xd[1] || yd.size() != 2
      || yd[0] != xd[0] || yd[1] != pd[0] * kLanes || xd[0] < 1)
    return ffi::Error::InvalidArgument(
        "widened_strip_matmul: x [M, K] (M >= 1), packed [N/16, K/2, 16, 2] and y [M, N] expected");
  const int64_t m = xd[0], k_size = xd[1], strips = pd[0], passes = (m + kRowsPerPass - 1) / kRowsPerPass;
  const std::unique_ptr<float[]> rows(new float[m * k_size]);  // every element written below
  const auto widen = [&](int64_t begin, int64_t end) {
    agentgym::WidenPasses(Bits(x), m, k_size, kRowsPerPass, begin, end, rows.get());
  };
  if (m > kMaxDecodeRows)
    agentgym::Parallel(pool, passes, widen);
  else
    widen(0, passes);  // a few microseconds: not worth waking a thread
  const uint16_t* wp = Bits(packed);
  float* yp = y->typed_data();
  agentgym::Parallel(pool, (strips + kStripsPerPanel - 1) / kStripsPerPanel, [&](int64_t begin, int64_t end) {
    Panels(rows.get(), m, k_size, wp, strips, begin, end, yp);
  });
  return ffi::Error::Success();
}

// packed [N/16, K/2, 16, 2] from w [K, N] (transposed: w [N, K], a tied output head): strip s, pair row kp, lane c
// holds w[2kp, 16s + c] and w[2kp + 1, 16s + c] (transposed: w[16s + c, 2kp] and w[16s + c, 2kp + 1], one 32-bit
// word of w's row, gathered 16 rows at a time).
ffi::Error Bf16StripPack(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> w, bool transposed,
                         ffi::ResultBuffer<ffi::BF16> packed) {
  const auto wd = w.dimensions(), pd = packed->dimensions();
  const int64_t k_size = wd.size() == 2 ? wd[transposed ? 1 : 0] : 0, n = wd.size() == 2 ? wd[transposed ? 0 : 1] : 0;
  if (wd.size() != 2 || n % kLanes || k_size % 2 || pd.size() != 4 || pd[0] * kLanes != n || 2 * pd[1] != k_size
      || pd[2] != kLanes || pd[3] != 2)
    return ffi::Error::InvalidArgument(
        "bf16_strip_pack: w [K, N] (transposed: [N, K]) with K even and N a multiple of 16, and packed "
        "[N/16, K/2, 16, 2] expected");
  const uint16_t* wp = Bits(w);
  auto* out = reinterpret_cast<uint16_t*>(packed->untyped_data());
  const int64_t strip_size = k_size * kLanes;
  agentgym::Parallel(pool, n / kLanes, [&](int64_t begin, int64_t end) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(k_size / 2)));
    for (int64_t s = begin; s < end; ++s) {
      if (!transposed) {
        agentgym::PackPairPanel(wp, k_size, n, s * kLanes, kLanes, out + s * strip_size);
        continue;
      }
      const auto* words = reinterpret_cast<const int32_t*>(wp + s * kLanes * k_size);
      for (int64_t kp = 0; kp < k_size / 2; ++kp)
        _mm512_storeu_si512(out + s * strip_size + kp * 2 * kLanes, _mm512_i32gather_epi32(rows, words + kp, 4));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymWidenedStripMatmul, WidenedStripMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymBf16StripPack, Bf16StripPack,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Attr<bool>("transposed").Ret<ffi::Buffer<ffi::BF16>>());
