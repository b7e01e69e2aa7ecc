// bf16 products on CPUs with AVX512-BF16 and no AMX, for XLA's CPU backend (XLA FFI custom calls), accumulated in
// fp32: y [M, N] = x [M, K] @ w [K, N] for many rows (a prompt's prefill, the training forward pass), returned in
// fp32 or rounded to bf16, and a decode step's products of at most 32 rows on w packed once per parameter update.
//
// XLA's CPU backend runs a bf16 dot by converting both operands to fp32 and multiplying those, at the fp32 FMA rate.
// vdpbf16ps multiplies 16 pairs of bf16 numbers and adds both products to 16 fp32 sums: twice the multiplies of an
// fp32 FMA per instruction. Each thread takes a range of 48-column panels of w (three 16-column strips; the last
// panel may hold fewer), and goes through them in groups of at most kGroupBytes, each group packed once into pair
// rows ([K/2][width][2]: row kp holds w[2kp, c] and w[2kp + 1, c] next to each other for every column c) that stay
// in L2. For every 8 rows of x (read from L1 across the group) it keeps each panel's 8 x 48 outputs in 24
// registers across all of K, broadcasting each row's pair (x[r, 2kp], x[r, 2kp + 1]) against the panel's pair row.
// vdpbf16ps sums each pair before adding it, and treats subnormal inputs and results as zero: the sums differ from
// an fp32 dot of the widened operands by rounding only. Pure-JAX reference: the dot in agentgym_jax.mixed_matmul
// (tests/test_bf16_gemm.py compares them).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_pairs.h"
#include "parallel.h"
#include "pass_rows.h"
#include "prefetch.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512BF16__
#error "bf16_gemm needs AVX512-BF16 (agentgym_jax.native_kernels only builds it where the CPU has it)"
#endif

namespace ffi = xla::ffi;
using agentgym::Prefetch;

namespace {

constexpr int64_t kLanes = 16, kStripsPerPanel = 3, kPanelWidth = kLanes * kStripsPerPanel, kRows = 8;
constexpr int64_t kGroupBytes = 512 << 10;

inline void Store(float* y, __m512 sums) { _mm512_storeu_ps(y, sums); }
inline void Store(uint16_t* y, __m512 sums) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), agentgym::RoundToBf16(sums));
}

// y[0:R, 16 S columns] (row stride n) for x's R rows (row stride k_size; kInterleaved: their pairs [K/2][R], see
// agentgym::PassRows) against S strips of pair rows: strip s's pair row kp (16 columns x 2) at w + s * strip_stride +
// kp * row_stride (a panel's strips share each pair row; a decode step's packed strips are each one stream).
template <int R, int S, typename Out, bool kPrefetch, bool kInterleaved>
void Block(const uint16_t* x, int64_t k_size, const uint16_t* w, int64_t strip_stride, int64_t row_stride, Out* y,
           int64_t n, const Prefetch& prefetch) {
  __m512 acc[R][S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    if constexpr (kPrefetch) prefetch.Step(kp);
    __m512bh pairs[S];
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) pairs[s] = agentgym::LoadPairs(w + s * strip_stride + kp * row_stride);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = agentgym::BroadcastPair(kInterleaved ? x + 2 * (kp * R + r) : x + r * k_size + 2 * kp);
#pragma GCC unroll 3
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xr, pairs[s]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int s = 0; s < S; ++s) Store(y + r * n + s * kLanes, acc[r][s]);
}

template <int S, bool kPrefetch, bool kInterleaved, typename Out>
void Rows(int64_t rows, const uint16_t* x, int64_t k_size, const uint16_t* w, int64_t strip_stride, int64_t row_stride,
          Out* y, int64_t n, const Prefetch& prefetch) {
  switch (rows) {
    case 1: return Block<1, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    case 2: return Block<2, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    case 3: return Block<3, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    case 4: return Block<4, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    case 5: return Block<5, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    case 6: return Block<6, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    case 7: return Block<7, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
    default: return Block<8, S, Out, kPrefetch, kInterleaved>(x, k_size, w, strip_stride, row_stride, y, n, prefetch);
  }
}

// rows (at most kRows) of x (row stride k_size, or interleaved) against `strips` (1 to 3) strips at w, into out (row
// stride n).
template <bool kInterleaved, typename Out>
void Strips(int64_t strips, int64_t rows, const uint16_t* x, int64_t k_size, const uint16_t* w, int64_t strip_stride,
            int64_t row_stride, Out* out, int64_t n, const Prefetch& prefetch = {}) {
  const auto rows_of = [&](auto strips_constant) {
    constexpr int kStrips = decltype(strips_constant)::value;
    if (prefetch.count)
      Rows<kStrips, true, kInterleaved>(rows, x, k_size, w, strip_stride, row_stride, out, n, prefetch);
    else
      Rows<kStrips, false, kInterleaved>(rows, x, k_size, w, strip_stride, row_stride, out, n, prefetch);
  };
  if (strips == 3)
    rows_of(std::integral_constant<int, 3>{});
  else if (strips == 2)
    rows_of(std::integral_constant<int, 2>{});
  else
    rows_of(std::integral_constant<int, 1>{});
}

// silu(gate) * up for rows x width fp32 products in L1 buffers (row stride kPanelWidth), as bf16 into y.
void StoreSwiGLU(const float* gate, const float* up, int64_t rows, int64_t width, uint16_t* y, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; c += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + c),
                          agentgym::SwiGLU16(_mm512_loadu_ps(gate + r * kPanelWidth + c),
                                             _mm512_loadu_ps(up + r * kPanelWidth + c)));
}

// One panel (`width` columns, strips at w with the given strides) for rows [r, r + kRows) of x: into y[:, col:], or
// with an up panel (kSwiGLU), silu(x @ panel) * (x @ up panel) into bf16 y, neither product leaving L1. kInterleaved:
// x is agentgym::PassRows' layout.
template <typename Out, bool kSwiGLU, bool kInterleaved = false>
void Panel(const uint16_t* x, int64_t m, int64_t r, int64_t k_size, const uint16_t* w, const uint16_t* up,
           int64_t strip_stride, int64_t row_stride, int64_t width, Out* y, int64_t n, int64_t col,
           const Prefetch& w_next = {}, const Prefetch& up_next = {}) {
  const int64_t rows = std::min(kRows, m - r);
  const uint16_t* xr = x + r * k_size;  // the same offset in both layouts: a pass's rows hold K numbers each
  if constexpr (kSwiGLU) {
    alignas(64) float gate_block[kRows * kPanelWidth], up_block[kRows * kPanelWidth];
    Strips<kInterleaved>(width / kLanes, rows, xr, k_size, w, strip_stride, row_stride, gate_block, kPanelWidth,
                         w_next);
    Strips<kInterleaved>(width / kLanes, rows, xr, k_size, up, strip_stride, row_stride, up_block, kPanelWidth,
                         up_next);
    StoreSwiGLU(gate_block, up_block, rows, width, y + r * n + col, n);
  } else {
    Strips<kInterleaved>(width / kLanes, rows, xr, k_size, w, strip_stride, row_stride, y + r * n + col, n, w_next);
  }
}

// y[:, 48 p0 : 48 p1] for all of x's rows (the last panel may hold fewer than 3 strips); kSwiGLU: up_w is the up
// projection's [K, N] and y gets silu(x @ w) * (x @ up_w).
template <typename Out, bool kSwiGLU = false>
void Panels(const uint16_t* x, int64_t m, int64_t k_size, const uint16_t* w, int64_t n, int64_t p0, int64_t p1,
            Out* y, const uint16_t* up_w = nullptr) {
  constexpr int64_t kWeights = kSwiGLU ? 2 : 1;
  const int64_t panel_size = k_size * kPanelWidth;  // bf16 numbers in a whole panel
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (panel_size * 2 * kWeights));
  std::vector<uint16_t> packed(std::min(group, p1 - p0) * panel_size * kWeights);
  const auto width = [&](int64_t p) { return std::min(kPanelWidth, n - p * kPanelWidth); };
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    const auto panel = [&](int64_t p, int64_t which) {  // which: 0 w (the gate), 1 the up projection
      return packed.data() + ((p - g0) * kWeights + which) * panel_size;
    };
    for (int64_t p = g0; p < g1; ++p) {
      agentgym::PackPairPanel(w, k_size, n, p * kPanelWidth, width(p), panel(p, 0));
      if constexpr (kSwiGLU) agentgym::PackPairPanel(up_w, k_size, n, p * kPanelWidth, width(p), panel(p, 1));
    }
    for (int64_t r = 0; r < m; r += kRows)
      for (int64_t p = g0; p < g1; ++p)
        Panel<Out, kSwiGLU>(x, m, r, k_size, panel(p, 0), kSwiGLU ? panel(p, 1) : nullptr, 2 * kLanes,
                            2 * width(p), width(p), y, n, p * kPanelWidth);
  }
}

const uint16_t* Bits(const ffi::Buffer<ffi::BF16>& buffer) {  // a bf16 buffer's numbers as their bits
  return reinterpret_cast<const uint16_t*>(buffer.untyped_data());
}

// y [M, N] fp32, or bf16 (rounded from the fp32 sums as XLA's convert rounds: half the bytes written).
ffi::Error Bf16Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1])
    return ffi::Error::InvalidArgument("bf16_gemm: x [M, K], w [K, N] and y [M, N] expected");
  const auto out_type = y->element_type();
  if (out_type != ffi::F32 && out_type != ffi::BF16)
    return ffi::Error::InvalidArgument("bf16_gemm: y must be fp32 or bf16");
  const int64_t m = xd[0], k_size = xd[1], n = wd[1];
  if (k_size % 2 || n % kLanes)
    return ffi::Error::InvalidArgument("bf16_gemm: K must be even and N a multiple of 16");
  const uint16_t* xp = Bits(x);
  const uint16_t* wp = Bits(w);
  void* yp = y->untyped_data();
  const int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  agentgym::Parallel(pool, panels, [&](int64_t begin, int64_t end) {
    if (out_type == ffi::F32)
      Panels(xp, m, k_size, wp, n, begin, end, static_cast<float*>(yp));
    else
      Panels(xp, m, k_size, wp, n, begin, end, static_cast<uint16_t*>(yp));
  });
  return ffi::Error::Success();
}

// The shapes of a decode step's product on packed strips: x [M, K] (1 <= M <= 32), packed [N/16, K/2, 16, 2]
// (each of them, for SwiGLU's two), y [M, N]; an empty string where they agree.
const char* StripShapesError(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> pd,
                             ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || pd.size() != 4 || pd[2] != kLanes || pd[3] != 2 || 2 * pd[1] != xd[1] || yd.size() != 2
      || yd[0] != xd[0] || yd[1] != pd[0] * kLanes)
    return "x [M, K], packed [N/16, K/2, 16, 2] and y [M, N] expected";
  if (xd[0] < 1 || xd[0] > 32) return "needs 1 <= M <= 32";
  return "";
}

// y for x's rows against the strips packed at w (and, kSwiGLU, silu of that times x against those at up): each thread
// takes a range of three-strip panels; rows past the first 8 read the panel's strips again, from L2, and each pass
// over a panel also brings a share of the thread's next panel into L2 (Prefetch).
template <typename Out, bool kSwiGLU>
void StripPanels(ffi::ThreadPool& pool, const uint16_t* x, int64_t m, int64_t k_size, const uint16_t* w,
                 const uint16_t* up, int64_t strips, Out* y) {
  const int64_t strip_size = k_size * kLanes, n = strips * kLanes;  // bf16 numbers in a strip; columns
  const int64_t passes = (m + kRows - 1) / kRows;
  const std::vector<uint32_t> pairs = agentgym::PassRows<uint32_t>(x, m, k_size / 2, kRows);
  const auto* xi = reinterpret_cast<const uint16_t*>(pairs.data());
  agentgym::Parallel(pool, (strips + kStripsPerPanel - 1) / kStripsPerPanel, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kStripsPerPanel, count = std::min(kStripsPerPanel, strips - first);
      // the thread's next panel (its strips follow this panel's), a share of it during each pass; not below 8 rows,
      // where a product only streams its weights (batch 1 was no faster with it)
      const int64_t next_strips = p + 1 < end && m >= kRows ? std::min(kStripsPerPanel, strips - first - count) : 0;
      const int64_t next_bytes = next_strips * strip_size * int64_t{sizeof(uint16_t)};
      for (int64_t r = 0; r < m; r += kRows) {
        const auto next = [&](const uint16_t* weights) {
          return Prefetch::Share(weights + (first + count) * strip_size, next_bytes, r / kRows, passes, k_size / 2);
        };
        Panel<Out, kSwiGLU, true>(xi, m, r, k_size, w + first * strip_size,
                                  kSwiGLU ? up + first * strip_size : nullptr, strip_size, 2 * kLanes, count * kLanes,
                                  y, n, first * kLanes, next(w), kSwiGLU ? next(up) : Prefetch{});
      }
    }
  });
}

// A decode step's bf16 projections, y [M, N] fp32 = x [M, K] @ w for M <= 32, on w packed once per parameter update by
// Bf16StripPack (pair_strips.cc) into strips of pair rows [N/16, K/2, 16, 2] (fp32 strip_matmul's scheme, with half
// the bytes and half the instructions: no widening, two k per dot product).
ffi::Error Bf16StripMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                           ffi::ResultBuffer<ffi::F32> y) {
  const std::string error = StripShapesError(x.dimensions(), packed.dimensions(), y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument("bf16_strip_matmul: " + error);
  StripPanels<float, false>(pool, Bits(x), x.dimensions()[0], x.dimensions()[1], Bits(packed), nullptr,
                            packed.dimensions()[0], y->typed_data());
  return ffi::Error::Success();
}

// The MLP's silu(x @ gate) * (x @ up) in one pass for a decode step, bf16 out, on both packed by Bf16StripPack (pair_strips.cc).
ffi::Error Bf16StripSwiGLU(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gate,
                           ffi::Buffer<ffi::BF16> up, ffi::ResultBuffer<ffi::BF16> y) {
  std::string error = StripShapesError(x.dimensions(), gate.dimensions(), y->dimensions());
  if (error.empty() && !std::equal(gate.dimensions().begin(), gate.dimensions().end(), up.dimensions().begin(),
                                   up.dimensions().end()))
    error = "gate and up packed alike expected";
  if (!error.empty()) return ffi::Error::InvalidArgument("bf16_strip_swiglu: " + error);
  StripPanels<uint16_t, true>(pool, Bits(x), x.dimensions()[0], x.dimensions()[1], Bits(gate), Bits(up),
                              gate.dimensions()[0], reinterpret_cast<uint16_t*>(y->untyped_data()));
  return ffi::Error::Success();
}

// The MLP's silu(x @ gate) * (x @ up) in one pass for many rows (a prompt's prefill), bf16 out: x [M, K], gate and
// up [K, N], their panels packed per call as Bf16Gemm packs w's.
ffi::Error Bf16SwiGLU(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gate,
                      ffi::Buffer<ffi::BF16> up, ffi::ResultBuffer<ffi::BF16> y) {
  const auto xd = x.dimensions(), wd = gate.dimensions(), ud = up.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || ud.size() != 2 || xd[1] != wd[0] || ud[0] != wd[0] || ud[1] != wd[1]
      || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1] || wd[0] % 2 || wd[1] % kLanes)
    return ffi::Error::InvalidArgument(
        "bf16_swiglu: x [M, K], gate and up [K, N], y [M, N] with K even and N a multiple of 16 expected");
  const int64_t m = xd[0], k_size = xd[1], n = wd[1];
  auto* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  agentgym::Parallel(pool, (n + kPanelWidth - 1) / kPanelWidth, [&](int64_t begin, int64_t end) {
    Panels<uint16_t, true>(Bits(x), m, k_size, Bits(gate), n, begin, end, yp, Bits(up));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymBf16Gemm, Bf16Gemm,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymBf16StripMatmul, Bf16StripMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymBf16StripSwiGLU, Bf16StripSwiGLU,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymBf16SwiGLU, Bf16SwiGLU,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
