// A decode step's projections, y [M, N] fp32 = x [M, K] @ w [K, N] (or @ w [N, K]^T, a tied output head) with bf16
// operands and M <= 32 rows, on Intel AMX tiles (an XLA FFI custom call for XLA's CPU backend).
//
// At a few rows a projection only streams its weights; XLA's CPU dots ran the model's bf16 decode-step products
// well below the memory bandwidth (27.5 ms for the 210 projections of SmolLM2-135M at 8 rows against 20 ms here,
// 2-core Xeon). Each thread takes a range of 32-column panels; for every 32-row block of w it loads x's block into
// a tile once, then per panel reorders w's rows pairwise into the tiles' VNNI layout (two bf16 of consecutive k
// per fp32 lane), multiplies, and accumulates the panel's output in y. A transposed w [N, K] is already laid out as
// tile rows: the kernel computes y^T = w x^T, 32 of w's rows at a time, against x^T reordered once per call. Rows
// 17-32 of x take a second set of tiles, so a weight block is reordered once for all rows. Pure-JAX
// reference: the fp32-accumulated dot in agentgym_jax.mixed_matmul (tests/test_native_kernels.py compares them).
// Weights read by many steps (the generate program's loop) are packed once (AmxPack) and streamed panel by panel
// (AmxMatmulPacked); the MLP's gate and up are packed together (AmxPackPair) for AmxSwiGLUPacked, which writes
// silu(gate) * up in bf16 without either product leaving L1. Products of more than 32 rows (prefill, training
// rows) take native/amx_gemm.cc (tests/test_amx_gemm.py); the shared blocks are in amx_blocks.h.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_blocks.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// 1 when the OS grants this process AMX tiles (asked once).
extern "C" int AgentgymAmxReady() { return agentgym::AmxGranted() ? 1 : 0; }

namespace {

using namespace agentgym::amx;  // NOLINT: the blocks shared with amx_gemm.cc

// y[:, c0:c1] for x [M, K] and w [K, N] (bf16 bits), M <= 32 (more than 16: kTwoGroups), K and the column range
// multiples of 32.
template <bool kTwoGroups>
void Columns(const uint16_t* x, const uint16_t* w, int64_t k_size, int64_t n, int64_t c0, int64_t c1, float* y) {
  alignas(64) uint16_t block[1024];  // w's panel block in VNNI order: columns 0-15, then 16-31
  const agentgym::PairInterleave pairs;  // lane c of a VNNI row: (row 2r, column c), (row 2r + 1, column c)
  const uint16_t* x1 = x + kTileRows * k_size;  // group 1's rows
  float* y1 = y + kTileRows * n;
  for (int64_t k = 0; k < k_size; k += kBlock) {
    _tile_loadd(2, x + k, k_size * 2);
    if (kTwoGroups) _tile_loadd(7, x1 + k, k_size * 2);
    for (int64_t c = c0; c < c1; c += kBlock) {
      if (k == 0) {
        _tile_zero(0);
        _tile_zero(1);
        if (kTwoGroups) {
          _tile_zero(5);
          _tile_zero(6);
        }
      } else {
        _tile_loadd(0, y + c, n * 4);
        _tile_loadd(1, y + c + 16, n * 4);
        if (kTwoGroups) {
          _tile_loadd(5, y1 + c, n * 4);
          _tile_loadd(6, y1 + c + 16, n * 4);
        }
      }
      ReorderBlock(w + k * n + c, n, pairs, block);
      asm volatile("" ::: "memory");  // the tile loads below read the block: the compiler must keep the stores
      _tile_loadd(3, block, 64);
      _tile_loadd(4, block + 512, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
      _tile_stored(0, y + c, n * 4);
      _tile_stored(1, y + c + 16, n * 4);
      if (kTwoGroups) {
        _tile_dpbf16ps(5, 7, 3);
        _tile_dpbf16ps(6, 7, 4);
        _tile_stored(5, y1 + c, n * 4);
        _tile_stored(6, y1 + c + 16, n * 4);
      }
    }
  }
}

// x^T in the tiles' VNNI order, one 16 x 32 block per 32 values of k and group of 16 rows: block b, group g, row p,
// lane j holds (x[16g + j, 32b + 2p], x[16g + j, 32b + 2p + 1]).
void TransposePairs(const uint16_t* x, int64_t m, int64_t k_size, uint16_t* pairs) {
  for (int64_t b = 0; b < k_size / kBlock; ++b)
    for (int64_t i = 0; i < m; ++i) {
      const int64_t g = i / kTileRows, j = i % kTileRows;
      for (int p = 0; p < 16; ++p) {
        uint16_t* pair = pairs + ((b * 2 + g) * 16 + p) * 32 + 2 * j;
        pair[0] = x[i * k_size + b * kBlock + 2 * p];
        pair[1] = x[i * k_size + b * kBlock + 2 * p + 1];
      }
    }
}

// y[:, r0:r1] = x @ w[r0:r1]^T for w [N, K], from x^T's pairs; r0, r1 multiples of 32. Each block's y^T tiles are
// written out as y's rows a few rows per k block of the next block, the copies beside its tile products (a tied
// head at batch 32: 2.3 -> ~1.6 ms; after the products they took a third of the call).
template <bool kTwoGroups>
void RowsOfTransposed(const uint16_t* pairs, const uint16_t* w, int64_t m, int64_t k_size, int64_t n, int64_t r0,
                      int64_t r1, float* y) {
  // y^T for 16 of w's rows x 16 of x's rows: (w block, group) 00, 10, 01, 11; two blocks' worth, in turn
  alignas(64) float blocks[2][4][16 * 16];
  const int64_t k_blocks = k_size / kBlock, rows_per_step = (m + k_blocks - 1) / k_blocks;
  PendingRows pending;  // x's rows of the last block's outputs (its first row of w: `last`) still to copy
  int64_t last = 0;
  const auto copy_row = [&](int64_t j) {
    const float* lane = blocks[(last / kBlock) % 2][2 * (j / kTileRows)] + j % kTileRows;
    float* out = y + j * n + last;
    for (int i = 0; i < 32; ++i) out[i] = lane[(i / 16) * 256 + (i % 16) * 16];
  };
  for (int64_t r = r0; r < r1; r += kBlock) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwoGroups) {
      _tile_zero(5);
      _tile_zero(6);
    }
    for (int64_t k = 0; k < k_size; k += kBlock) {
      const uint16_t* group0 = pairs + (k / kBlock) * 2 * 16 * 32;
      _tile_loadd(4, group0, 64);
      _tile_loadd(2, w + r * k_size + k, k_size * 2);
      _tile_loadd(3, w + (r + 16) * k_size + k, k_size * 2);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      if (kTwoGroups) {
        _tile_loadd(7, group0 + 16 * 32, 64);
        _tile_dpbf16ps(5, 2, 7);
        _tile_dpbf16ps(6, 3, 7);
      }
      pending.Take(rows_per_step, copy_row);
    }
    pending.Finish(copy_row);
    float (*block)[16 * 16] = blocks[(r / kBlock) % 2];
    _tile_stored(0, block[0], 64);
    _tile_stored(1, block[1], 64);
    if (kTwoGroups) {
      _tile_stored(5, block[2], 64);
      _tile_stored(6, block[3], 64);
    }
    asm volatile("" ::: "memory");  // the copies read the tile stores
    last = r;
    pending.Start(m);
  }
  pending.Finish(copy_row);
}

ffi::Error AmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, bool transposed,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("amx_matmul: x [M, K] and w [K, N] (transposed: [N, K]) expected");
  const int64_t m = xd[0], k_size = xd[1], n = wd[transposed ? 0 : 1];
  if (m < 1 || m > kMaxRows || k_size % kBlock || n % kBlock)
    return ffi::Error::InvalidArgument("amx_matmul: needs 1 <= M <= 32 and K, N multiples of 32");
  if (!AgentgymAmxReady()) return ffi::Error::Internal("amx_matmul: the OS did not grant this process AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  if (transposed) {
    std::vector<uint16_t> pairs(k_size / kBlock * 2 * 16 * 32, 0);
    TransposePairs(xp, m, k_size, pairs.data());
    agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
      ConfigureTiles(m, true);
      if (m > kTileRows)
        RowsOfTransposed<true>(pairs.data(), wp, m, k_size, n, begin * kBlock, end * kBlock, yp);
      else
        RowsOfTransposed<false>(pairs.data(), wp, m, k_size, n, begin * kBlock, end * kBlock, yp);
      _tile_release();
    });
    return ffi::Error::Success();
  }
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    ConfigureTiles(m, false);
    if (m > kTileRows)
      Columns<true>(xp, wp, k_size, n, begin * kBlock, end * kBlock, yp);
    else
      Columns<false>(xp, wp, k_size, n, begin * kBlock, end * kBlock, yp);
    _tile_release();
  });
  return ffi::Error::Success();
}

// packed [N/32, K/32, 2, 16, 16, 2] for PackedPanels from w [K, N].
ffi::Error AmxPack(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::BF16> packed) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || wd[0] % kBlock || wd[1] % kBlock)
    return ffi::Error::InvalidArgument("amx_pack: w [K, N] with K and N multiples of 32 expected");
  const auto* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  auto* out = reinterpret_cast<uint16_t*>(packed->untyped_data());
  agentgym::Parallel(pool, wd[0] / kBlock, [&](int64_t begin, int64_t end) {
    PackPanels(wp, wd[0], wd[1], begin, end, 0, 1, out);
  });
  return ffi::Error::Success();
}

// packed [2N/32, K/32, 2, 16, 16, 2] from gate and up [K, N]: their panels in turn (gate 0, up 0, gate 1, ...).
ffi::Error AmxPackPair(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> gate, ffi::Buffer<ffi::BF16> up,
                       ffi::ResultBuffer<ffi::BF16> packed) {
  const auto wd = gate.dimensions();
  if (wd.size() != 2 || wd[0] % kBlock || wd[1] % kBlock || up.dimensions().size() != 2 ||
      up.dimensions()[0] != wd[0] || up.dimensions()[1] != wd[1])
    return ffi::Error::InvalidArgument("amx_pack_pair: gate and up [K, N] with K and N multiples of 32 expected");
  const auto* gp = reinterpret_cast<const uint16_t*>(gate.untyped_data());
  const auto* up_p = reinterpret_cast<const uint16_t*>(up.untyped_data());
  auto* out = reinterpret_cast<uint16_t*>(packed->untyped_data());
  agentgym::Parallel(pool, wd[0] / kBlock, [&](int64_t begin, int64_t end) {
    PackPanels(gp, wd[0], wd[1], begin, end, 0, 2, out);
    PackPanels(up_p, wd[0], wd[1], begin, end, 1, 2, out);
  });
  return ffi::Error::Success();
}

ffi::Error AmxMatmulPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions();
  if (xd.size() != 2 || pd.size() != 6 || pd[1] * kBlock != xd[1])
    return ffi::Error::InvalidArgument("amx_matmul_packed: x [M, K] and w packed [N/32, K/32, 2, 16, 16, 2]");
  const int64_t m = xd[0], k_size = xd[1], n = pd[0] * kBlock;
  if (m < 1 || m > kMaxRows) return ffi::Error::InvalidArgument("amx_matmul_packed: needs 1 <= M <= 32");
  if (!AgentgymAmxReady()) return ffi::Error::Internal("amx_matmul: the OS did not grant this process AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.untyped_data());
  float* yp = y->typed_data();
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    ConfigureTiles(m, false);
    if (m > kTileRows)
      PackedPanels<true>(xp, wp, k_size, n, begin, end, yp);
    else
      PackedPanels<false>(xp, wp, k_size, n, begin, end, yp);
    _tile_release();
  });
  return ffi::Error::Success();
}

ffi::Error AmxSwiGLUPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                           ffi::ResultBuffer<ffi::BF16> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 6 || pd[1] * kBlock != xd[1] || pd[0] % 2 || yd.size() != 2 ||
      yd[0] != xd[0] || yd[1] * 2 != pd[0] * kBlock)
    return ffi::Error::InvalidArgument("amx_swiglu_packed: x [M, K], w [K, 2N] packed, y [M, N]");
  const int64_t m = xd[0], k_size = xd[1], k_blocks = pd[1], n = yd[1];
  if (m < 1 || m > kMaxRows) return ffi::Error::InvalidArgument("amx_swiglu_packed: needs 1 <= M <= 32");
  if (!AgentgymAmxReady()) return ffi::Error::Internal("amx_swiglu: the OS did not grant this process AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.untyped_data());
  auto* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    ConfigureTiles(m, false);
    // Two output panels' products, a row's gate outputs then its up outputs: one filled by the tiles while the
    // other's SwiGLU is stored a row per k block, the vector work beside the tiles' as in native/amx_gemm.cc.
    alignas(64) float both[2][kMaxRows * 2 * kBlock];
    PendingRows pending;  // rows of the last output panel (`last`) still to store
    int64_t last = 0;
    const auto store_row = [&](int64_t r) {
      const float* row = both[last % 2] + r * 2 * kBlock;
      StoreSwiGLU(row, row + kBlock, 1, 2 * kBlock, yp + r * n + last * kBlock, n);
    };
    const auto step = [&] { pending.Take(1, store_row); };
    for (int64_t j = begin; j < end; ++j) {
      const uint16_t* pair = wp + 2 * j * k_blocks * 1024;
      if (m > kTileRows)
        PackedPanels<true>(xp, pair, k_size, 2 * kBlock, 0, 2, both[j % 2], step);
      else
        PackedPanels<false>(xp, pair, k_size, 2 * kBlock, 0, 2, both[j % 2], step);
      asm volatile("" ::: "memory");  // the reads of the rows see the tile stores
      pending.Finish(store_row);
      last = j;
      pending.Start(m);
    }
    pending.Finish(store_row);
    _tile_release();
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxMatmul, AmxMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Attr<bool>("transposed")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxMatmulPacked, AmxMatmulPacked,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxPack, AmxPack,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxPackPair, AmxPackPair,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxSwiGLUPacked, AmxSwiGLUPacked,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::Buffer<ffi::BF16>>());
