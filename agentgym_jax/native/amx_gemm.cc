// Products of many rows (a prompt's prefill, training rows) on Intel AMX tiles, for XLA's CPU backend (XLA FFI
// custom calls): y [M, N] = x [M, K] @ w [K, N] in fp32 or bf16, and the MLP's silu(x @ gate) * (x @ up) in one
// pass. Decode-step products of at most 32 rows are native/amx_matmul.cc's.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_blocks.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace agentgym::amx;  // NOLINT: the blocks shared with amx_matmul.cc

// Many rows (a prompt's prefill, training rows): y [M, N] = x [M, K] @ w [K, N]. Each thread takes a range of
// 32-column panels and goes through them in groups of at most kGroupBytes reordered (all of them, for the model's
// projections), each group reordered once into the tiles' pair layout (32 rows of w at a time, each row read
// along the group's columns: 1.2-1.35x faster at 16-128 rows than panel after panel), a buffer that stays in L2;
// then for every 32 rows of x (their two 16-row tiles 4 and 5, read again for each panel of the group) it computes
// each panel's 32 x 32 output block in tiles 0-3 against the panel's two halves (6, 7), writing y row block by row
// block. A last block of fewer than 32 rows goes through a zero-padded copy. Against XLA's bf16 dots on the model's
// prefill shapes (128-4096 rows, 2-core Xeon): 1.05-2.1x.
constexpr int64_t kGroupBytes = 1 << 20;

void ConfigureGemmTiles() {
  agentgym::TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.Set(tile, 16, 64);
  asm volatile("" ::: "memory");  // GCC does not see ldtilecfg read config: keep the stores above
  _tile_loadconfig(&config);
}

// y[0:32, 0:32] (row stride y_stride) for 32 rows of x (row stride k_blocks * 32) against a reordered panel;
// between() runs after each k block's tile products.
template <typename Between>
void Block32(const uint16_t* x, const uint16_t* panel, int64_t k_blocks, float* y, int64_t y_stride,
             const Between& between) {
  const int64_t x_bytes = k_blocks * kBlock * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, x + kb * kBlock, x_bytes);
    _tile_loadd(5, x + 16 * k_blocks * kBlock + kb * kBlock, x_bytes);
    _tile_loadd(6, panel + kb * 1024, 64);
    _tile_loadd(7, panel + kb * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    between();
  }
  _tile_stored(0, y, y_stride * 4);
  _tile_stored(1, y + 16, y_stride * 4);
  _tile_stored(2, y + 16 * y_stride, y_stride * 4);
  _tile_stored(3, y + 16 * y_stride + 16, y_stride * 4);
}

// rows x 32 outputs from block ([.., 32] fp32, L1-resident) into y (row stride n): copied, or rounded to bf16.
void StoreRows(const float* block, int64_t rows, float* y, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) std::copy(block + r * kBlock, block + (r + 1) * kBlock, y + r * n);
}

void StoreRows(const float* block, int64_t rows, uint16_t* y, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kBlock; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + c),
                          agentgym::RoundToBf16(_mm512_loadu_ps(block + r * kBlock + c)));
}

// An output block's products and its last step (SwiGLU, or the rounding to bf16), written out a row at a time
// between the tile products of the next block (PendingRows; a prefill's [6400, 576] x [576, 2 x 1536] SwiGLU,
// harness on a 2-core Xeon: 12.3 -> 8.6 ms).
template <typename Out, bool kSwiGLU>
struct Epilogue {
  alignas(64) float gate[kMaxRows * kBlock];  // the block's products (the gate's, for SwiGLU)
  alignas(64) float up[kSwiGLU ? kMaxRows * kBlock : 1];
  Out* y = nullptr;
  int64_t y_stride = 0;
  PendingRows pending;

  void Start(Out* to, int64_t stride, int64_t count) { y = to, y_stride = stride, pending.Start(count); }
  void WriteRow(int64_t r) {
    if constexpr (kSwiGLU)
      StoreSwiGLU(gate + r * kBlock, up + r * kBlock, 1, kBlock, y + r * y_stride, y_stride);
    else
      StoreRows(gate + r * kBlock, 1, y + r * y_stride, y_stride);
  }
  void Step() {
    pending.Take(1, [this](int64_t r) { WriteRow(r); });
  }
  void Finish() {
    pending.Finish([this](int64_t r) { WriteRow(r); });
  }
};

// AmxGemm's work for panels [begin, end), writing Out (fp32, or bf16 bits rounded from the fp32 sums: half the
// bytes for the projections whose consumers take bf16; the tiles go through an L1 block first). kSwiGLU: wp and
// up_wp are the gate's and the up projection's [K, N/2], their panels taken in turn (gate 0, up 0, gate 1, ...; begin
// even), and y, bf16 [M, N/2], gets silu(gate) * up, neither product leaving L1.
// prepacked: w's panels already in the pair layout (AmxPack's [N/32, K/32, ...], or AmxPackPair's gate and up
// panels in turn for kSwiGLU), read in place of the per-call reorder (wp and up_wp unused).
template <typename Out, bool kSwiGLU = false>
void GemmPanels(const uint16_t* xp, const uint16_t* wp, int64_t m, int64_t k_size, int64_t n, int64_t begin,
                int64_t end, Out* yp, const uint16_t* up_wp = nullptr, const uint16_t* prepacked = nullptr) {
  constexpr bool kDirect = std::is_same_v<Out, float>;  // fp32 tiles go straight to y
  constexpr int64_t kStep = kSwiGLU ? 2 : 1;  // panels per output panel
  const int64_t k_blocks = k_size / kBlock, whole = m / kMaxRows * kMaxRows, tail = m - whole, y_cols = n / kStep;
  ConfigureGemmTiles();
  const agentgym::PairInterleave pairs;
  const int64_t panel_size = k_blocks * 1024;
  const int64_t fits = std::max<int64_t>(kStep, kGroupBytes / (panel_size * 2) / kStep * kStep);
  const int64_t group = std::min<int64_t>(end - begin, fits);
  std::vector<uint16_t> panels(prepacked ? 0 : group * panel_size), padded(tail ? kMaxRows * k_size : 0, 0);
  std::copy(xp + whole * k_size, xp + m * k_size, padded.begin());
  // two blocks' epilogues: one filled by the tiles while the other's rows are stored
  std::vector<Epilogue<Out, kSwiGLU>> epilogues(2);
  int current = 0;
  const auto none = [] {};
  // the output panel of w's panel p for 32 rows of x from row r (rows of them kept)
  const auto output = [&](const uint16_t* x, int64_t r, int64_t rows, int64_t p, const uint16_t* panel) {
    Out* y = yp + r * y_cols + p / kStep * kBlock;
    if constexpr (kDirect && !kSwiGLU) {
      if (rows == kMaxRows) return Block32(x, panel, k_blocks, y, y_cols, none);  // fp32 tiles straight to y
    }
    auto& next = epilogues[current];
    auto& previous = epilogues[1 - current];
    const auto step = [&] { previous.Step(); };
    Block32(x, panel, k_blocks, next.gate, kBlock, step);
    if constexpr (kSwiGLU) Block32(x, panel + panel_size, k_blocks, next.up, kBlock, step);
    asm volatile("" ::: "memory");  // the epilogue's reads see the tile stores
    previous.Finish();
    next.Start(y, y_cols, rows);
    current = 1 - current;
  };
  for (int64_t g0 = begin; g0 < end; g0 += group) {
    const int64_t g1 = std::min(end, g0 + group);
    for (int64_t kb = 0; kb < (prepacked ? 0 : k_blocks); ++kb)  // row blocks outermost: 32 rows of w at a time
      for (int64_t p = g0; p < g1; ++p) {
        uint16_t* out = panels.data() + (p - g0) * panel_size + kb * 1024;
        if constexpr (kSwiGLU)
          ReorderBlock((p % 2 ? up_wp : wp) + kb * kBlock * y_cols + p / 2 * kBlock, y_cols, pairs, out);
        else
          ReorderBlock(wp + kb * kBlock * n + p * kBlock, n, pairs, out);
      }
    asm volatile("" ::: "memory");  // the tile loads that read the panels come after these stores
    const auto panel = [&](int64_t p) {
      return prepacked ? prepacked + p * panel_size : panels.data() + (p - g0) * panel_size;
    };
    for (int64_t r = 0; r + kMaxRows <= m; r += kMaxRows)
      for (int64_t p = g0; p < g1; p += kStep) output(xp + r * k_size, r, kMaxRows, p, panel(p));
    if (tail)
      for (int64_t p = g0; p < g1; p += kStep) output(padded.data(), whole, tail, p, panel(p));
  }
  epilogues[1 - current].Finish();
  _tile_release();
}

// y [M, N] = x @ w in fp32 or bf16 (y's type), w as [K, N] (wp) or already packed (prepacked), over the pool.
void GemmInto(ffi::ThreadPool& pool, const uint16_t* xp, const uint16_t* wp, const uint16_t* prepacked, int64_t m,
              int64_t k_size, int64_t n, ffi::Result<ffi::AnyBuffer>& y) {
  void* yp = y->untyped_data();
  const bool fp32 = y->element_type() == ffi::F32;
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    if (fp32)
      GemmPanels(xp, wp, m, k_size, n, begin, end, static_cast<float*>(yp), nullptr, prepacked);
    else
      GemmPanels(xp, wp, m, k_size, n, begin, end, static_cast<uint16_t*>(yp), nullptr, prepacked);
  });
}

// y [M, N] fp32, or bf16 (the products whose consumers round to bf16 anyway: the same numbers, half the bytes).
ffi::Error AmxGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                   ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1])
    return ffi::Error::InvalidArgument("amx_gemm: x [M, K], w [K, N] and y [M, N] expected");
  const auto out_type = y->element_type();
  if (out_type != ffi::F32 && out_type != ffi::BF16)
    return ffi::Error::InvalidArgument("amx_gemm: y must be fp32 or bf16");
  const int64_t m = xd[0], k_size = xd[1], n = wd[1];
  if (k_size % kBlock || n % kBlock) return ffi::Error::InvalidArgument("amx_gemm: K and N must be multiples of 32");
  if (!agentgym::AmxGranted()) return ffi::Error::Internal("amx_gemm: the OS did not grant this process AMX tiles");
  GemmInto(pool, reinterpret_cast<const uint16_t*>(x.untyped_data()),
           reinterpret_cast<const uint16_t*>(w.untyped_data()), nullptr, m, k_size, n, y);
  return ffi::Error::Success();
}

// AmxGemm on w packed by AmxPack ([N/32, K/32, 2, 16, 16, 2]: the panels once per parameter update, no reorder).
ffi::Error AmxGemmPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                         ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 6 || pd[1] * kBlock != xd[1] || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != pd[0] * kBlock)
    return ffi::Error::InvalidArgument("amx_gemm_packed: x [M, K], w packed [N/32, K/32, 2, 16, 16, 2], y [M, N]");
  const auto out_type = y->element_type();
  if (out_type != ffi::F32 && out_type != ffi::BF16)
    return ffi::Error::InvalidArgument("amx_gemm_packed: y must be fp32 or bf16");
  if (!agentgym::AmxGranted()) return ffi::Error::Internal("amx_gemm: the OS did not grant this process AMX tiles");
  GemmInto(pool, reinterpret_cast<const uint16_t*>(x.untyped_data()), nullptr,
           reinterpret_cast<const uint16_t*>(packed.untyped_data()), xd[0], xd[1], yd[1], y);
  return ffi::Error::Success();
}

// SwiGLU's two products and silu(gate) * up in one pass, bf16 out, neither product written out: x [M, K] and the
// gate's and up projection's w [K, N] (many rows: their panels reordered per call, as AmxGemm does), or (at most 32
// rows, a decode step) both packed by AmxPackPair, their panels in turn.
ffi::Error AmxSwiGLU(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> gate,
                     ffi::Buffer<ffi::BF16> up, ffi::ResultBuffer<ffi::BF16> y) {
  const auto xd = x.dimensions(), wd = gate.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || up.dimensions().size() != 2 ||
      up.dimensions()[0] != wd[0] || up.dimensions()[1] != wd[1] || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != wd[1] || wd[0] % kBlock || wd[1] % kBlock)
    return ffi::Error::InvalidArgument("amx_swiglu: x [M, K], gate and up [K, N], y [M, N]; K, N multiples of 32");
  if (!agentgym::AmxGranted()) return ffi::Error::Internal("amx_swiglu: the OS did not grant this process AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* gp = reinterpret_cast<const uint16_t*>(gate.untyped_data());
  const auto* up_p = reinterpret_cast<const uint16_t*>(up.untyped_data());
  auto* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  const int64_t m = xd[0], k_size = xd[1], n = wd[1];
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    GemmPanels<uint16_t, true>(xp, gp, m, k_size, 2 * n, 2 * begin, 2 * end, yp, up_p);
  });
  return ffi::Error::Success();
}

// AmxSwiGLU on gate and up packed together by AmxPackPair ([2N/32, K/32, 2, 16, 16, 2]), any number of rows.
ffi::Error AmxSwiGLUPackedRows(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                               ffi::ResultBuffer<ffi::BF16> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 6 || pd[1] * kBlock != xd[1] || pd[0] % 2 || yd.size() != 2 ||
      yd[0] != xd[0] || yd[1] * 2 != pd[0] * kBlock)
    return ffi::Error::InvalidArgument("amx_swiglu_packed_rows: x [M, K], gate and up packed [2N/32, K/32, ...]");
  if (!agentgym::AmxGranted()) return ffi::Error::Internal("amx_swiglu: the OS did not grant this process AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.untyped_data());
  auto* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  const int64_t m = xd[0], k_size = xd[1], n = yd[1];
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    GemmPanels<uint16_t, true>(xp, nullptr, m, k_size, 2 * n, 2 * begin, 2 * end, yp, nullptr, wp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxGemmPacked, AmxGemmPacked,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxSwiGLUPackedRows, AmxSwiGLUPackedRows,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxGemm, AmxGemm,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxSwiGLU, AmxSwiGLU,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
