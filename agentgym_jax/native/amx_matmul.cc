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
// Products of more than 32 rows (prefill, training rows) take AmxGemm below (tests/test_amx_gemm.py).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// 1 when the OS grants this process AMX tiles (asked once).
extern "C" int AgentgymAmxReady() { return agentgym::AmxGranted() ? 1 : 0; }

namespace {

// x rows per tile, per call (two groups of tiles) and k rows and output columns per panel step
constexpr int64_t kTileRows = 16, kMaxRows = 32, kBlock = 32;

// x's rows go in two groups of at most 16 (one tile each): m0 = min(m, 16) and m1 = m - m0 (0: one group).
// x @ w: tiles 0 and 1 hold group 0's output halves (16 columns each, fp32), 2 group 0's x block; 5, 6 and 7 the
// same for group 1; 3 and 4 w's two halves of a panel block.
// x @ w^T: tiles 0 and 1 hold y^T for two 16-row blocks of w against group 0 (16 x m0 fp32), 5 and 6 against
// group 1; 2 and 3 those blocks of w; 4 and 7 the two groups' x^T blocks.
void ConfigureTiles(int64_t m, bool transposed) {
  agentgym::TileConfig config;
  const int64_t m0 = m < kTileRows ? m : kTileRows, m1 = m - m0;
  const auto set = [&](int tile, int64_t rows, int64_t bytes) { config.Set(tile, rows, bytes); };
  if (transposed) {
    for (int tile : {0, 1, 4}) set(tile, 16, 4 * m0);
    for (int tile : {2, 3}) set(tile, 16, 64);
    if (m1)
      for (int tile : {5, 6, 7}) set(tile, 16, 4 * m1);
  } else {
    for (int tile : {0, 1, 2}) set(tile, m0, 64);
    for (int tile : {3, 4}) set(tile, 16, 64);
    if (m1)
      for (int tile : {5, 6, 7}) set(tile, m1, 64);
  }
  asm volatile("" ::: "memory");  // GCC does not see ldtilecfg read config: keep the stores above
  _tile_loadconfig(&config);
}

// The 32 x 32 block of w whose first element is rows[0] (row stride n) in the tiles' pair layout: out[0, 512)
// holds columns 0-15, out[512, 1024) columns 16-31, pair row r lane c (rows[2r][c], rows[2r + 1][c]). Used by all
// three ways of reordering w: on the fly (Columns), once per call (AmxPack) and once per GEMM call (ReorderPanel).
inline void ReorderBlock(const uint16_t* rows, int64_t n, const agentgym::PairInterleave& pairs, uint16_t* out) {
  for (int r = 0; r < 16; ++r) {
    const __m512i even = _mm512_loadu_si512(rows + 2 * r * n), odd = _mm512_loadu_si512(rows + (2 * r + 1) * n);
    _mm512_storeu_si512(out + 32 * r, pairs.Low(even, odd));
    _mm512_storeu_si512(out + 512 + 32 * r, pairs.High(even, odd));
  }
}

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

// y[:, r0:r1] = x @ w[r0:r1]^T for w [N, K], from x^T's pairs; r0, r1 multiples of 32.
template <bool kTwoGroups>
void RowsOfTransposed(const uint16_t* pairs, const uint16_t* w, int64_t m, int64_t k_size, int64_t n, int64_t r0,
                      int64_t r1, float* y) {
  alignas(64) float block[4][16 * 16];  // y^T for 16 of w's rows x 16 of x's rows: (w block, group) 00, 10, 01, 11
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
    }
    _tile_stored(0, block[0], 64);
    _tile_stored(1, block[1], 64);
    if (kTwoGroups) {
      _tile_stored(5, block[2], 64);
      _tile_stored(6, block[3], 64);
    }
    asm volatile("" ::: "memory");  // the reads below see the tile stores
    for (int64_t j = 0; j < m; ++j) {
      const float* lane = block[2 * (j / kTileRows)] + j % kTileRows;
      for (int i = 0; i < 32; ++i) y[j * n + r + i] = lane[(i / 16) * 256 + (i % 16) * 16];
    }
  }
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

// y[:, 32 p0 : 32 p1] for x [M, K] and w packed by panels: packed[p][kb] holds w[32 kb : 32 kb + 32, 32 p : 32 p + 32]
// as two 16-column halves in the tiles' pair layout ([2][16][16][2], 2 KB), so each panel reads one contiguous
// stream and keeps its output in tiles across all of K.
template <bool kTwoGroups>
void PackedPanels(const uint16_t* x, const uint16_t* packed, int64_t k_size, int64_t n, int64_t p0, int64_t p1,
                  float* y) {
  const int64_t k_blocks = k_size / kBlock;
  const uint16_t* x1 = x + kTileRows * k_size;
  float* y1 = y + kTileRows * n;
  for (int64_t p = p0; p < p1; ++p) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwoGroups) {
      _tile_zero(5);
      _tile_zero(6);
    }
    const uint16_t* block = packed + p * k_blocks * 2 * 512;
    for (int64_t kb = 0; kb < k_blocks; ++kb, block += 1024) {
      _tile_loadd(2, x + kb * kBlock, k_size * 2);
      _tile_loadd(3, block, 64);
      _tile_loadd(4, block + 512, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
      if (kTwoGroups) {
        _tile_loadd(7, x1 + kb * kBlock, k_size * 2);
        _tile_dpbf16ps(5, 7, 3);
        _tile_dpbf16ps(6, 7, 4);
      }
    }
    _tile_stored(0, y + p * kBlock, n * 4);
    _tile_stored(1, y + p * kBlock + 16, n * 4);
    if (kTwoGroups) {
      _tile_stored(5, y1 + p * kBlock, n * 4);
      _tile_stored(6, y1 + p * kBlock + 16, n * 4);
    }
  }
}

// packed [N/32, K/32, 2, 16, 16, 2] for PackedPanels from w [K, N]: block (p, kb), half h, row r, lane c holds
// (w[32 kb + 2r, 32 p + 16 h + c], w[32 kb + 2r + 1, 32 p + 16 h + c]).
ffi::Error AmxPack(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::BF16> packed) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || wd[0] % kBlock || wd[1] % kBlock)
    return ffi::Error::InvalidArgument("amx_pack: w [K, N] with K and N multiples of 32 expected");
  const int64_t k_size = wd[0], n = wd[1], k_blocks = k_size / kBlock;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  auto* out = reinterpret_cast<uint16_t*>(packed->untyped_data());
  agentgym::Parallel(pool, k_blocks, [&](int64_t begin, int64_t end) {
    const agentgym::PairInterleave pairs;
    for (int64_t kb = begin; kb < end; ++kb)
      for (int64_t p = 0; p < n / kBlock; ++p)
        ReorderBlock(wp + kb * kBlock * n + p * kBlock, n, pairs, out + (p * k_blocks + kb) * 1024);
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

// Many rows (a prompt's prefill, training rows): y [M, N] = x [M, K] @ w [K, N]. Each thread takes a range of
// 32-column panels and goes through them in groups of at most kGroupBytes reordered (all of them, for the model's
// projections), each group reordered once into the tiles' pair layout, a buffer that stays in L2; then for every
// 32 rows of x (their two 16-row tiles 4 and 5, read again for each panel of the group) it computes each panel's
// 32 x 32 output block in tiles 0-3 against the panel's two halves (6, 7), writing y row block by row block. A last
// block of fewer than 32 rows goes through a zero-padded copy. Against XLA's bf16 dots on the model's prefill
// shapes (128-4096 rows, 2-core Xeon): 1.05-2.1x.
constexpr int64_t kGroupBytes = 1 << 20;

void ConfigureGemmTiles() {
  agentgym::TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.Set(tile, 16, 64);
  asm volatile("" ::: "memory");  // GCC does not see ldtilecfg read config: keep the stores above
  _tile_loadconfig(&config);
}

// out[kb] ([2][16][32] bf16 bits: the two 16-column halves' pair rows) for each 32-row block kb of w's panel p.
void ReorderPanel(const uint16_t* w, int64_t k_size, int64_t n, int64_t p, const agentgym::PairInterleave& pairs,
                  uint16_t* out) {
  for (int64_t kb = 0; kb < k_size / kBlock; ++kb)
    ReorderBlock(w + kb * kBlock * n + p * kBlock, n, pairs, out + kb * 1024);
  asm volatile("" ::: "memory");  // the tile loads that read out come after these stores
}

// y[0:32, 0:32] (row stride y_stride) for 32 rows of x (row stride k_blocks * 32) against a reordered panel.
void Block32(const uint16_t* x, const uint16_t* panel, int64_t k_blocks, float* y, int64_t y_stride) {
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

// AmxGemm's work for panels [begin, end), writing Out (fp32, or bf16 bits rounded from the fp32 sums: half the
// bytes for the projections whose consumers take bf16; the tiles go through an L1 block first).
template <typename Out>
void GemmPanels(const uint16_t* xp, const uint16_t* wp, int64_t m, int64_t k_size, int64_t n, int64_t begin,
                int64_t end, Out* yp) {
  constexpr bool kDirect = std::is_same_v<Out, float>;  // fp32 tiles go straight to y
  const int64_t k_blocks = k_size / kBlock, whole = m / kMaxRows * kMaxRows, tail = m - whole;
  ConfigureGemmTiles();
  const agentgym::PairInterleave pairs;
  const int64_t panel_size = k_blocks * 1024;
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(end - begin, kGroupBytes / (panel_size * 2)));
  std::vector<uint16_t> panels(group * panel_size), padded(tail ? kMaxRows * k_size : 0, 0);
  std::copy(xp + whole * k_size, xp + m * k_size, padded.begin());
  alignas(64) float block[kMaxRows * kBlock];
  for (int64_t g0 = begin; g0 < end; g0 += group) {
    const int64_t g1 = std::min(end, g0 + group);
    for (int64_t p = g0; p < g1; ++p) ReorderPanel(wp, k_size, n, p, pairs, panels.data() + (p - g0) * panel_size);
    for (int64_t r = 0; r + kMaxRows <= m; r += kMaxRows)
      for (int64_t p = g0; p < g1; ++p) {
        const uint16_t* panel = panels.data() + (p - g0) * panel_size;
        if constexpr (kDirect) {
          Block32(xp + r * k_size, panel, k_blocks, yp + r * n + p * kBlock, n);
        } else {
          Block32(xp + r * k_size, panel, k_blocks, block, kBlock);
          asm volatile("" ::: "memory");  // the reads below see the tile stores
          StoreRows(block, kMaxRows, yp + r * n + p * kBlock, n);
        }
      }
    if (tail) {
      for (int64_t p = g0; p < g1; ++p) {
        Block32(padded.data(), panels.data() + (p - g0) * panel_size, k_blocks, block, kBlock);
        asm volatile("" ::: "memory");  // the reads below see the tile stores
        StoreRows(block, tail, yp + whole * n + p * kBlock, n);
      }
    }
  }
  _tile_release();
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
  if (!AgentgymAmxReady()) return ffi::Error::Internal("amx_gemm: the OS did not grant this process AMX tiles");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  void* yp = y->untyped_data();
  agentgym::Parallel(pool, n / kBlock, [&](int64_t begin, int64_t end) {
    if (out_type == ffi::F32)
      GemmPanels(xp, wp, m, k_size, n, begin, end, static_cast<float*>(yp));
    else
      GemmPanels(xp, wp, m, k_size, n, begin, end, static_cast<uint16_t*>(yp));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymAmxGemm, AmxGemm,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Ret<ffi::AnyBuffer>());

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
