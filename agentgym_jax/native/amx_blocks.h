// Building blocks of the AMX kernels (native/amx_matmul.cc: decode-step products; native/amx_gemm.cc: products
// of many rows): tile configurations, the reorder of w into the tiles' pair layout, packed panels, and the SwiGLU
// epilogue. Each kernel library compiles its own copy.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "vector_math.h"

namespace agentgym {
namespace amx {

// x rows per tile, per call (two groups of tiles) and k rows and output columns per panel step
constexpr int64_t kTileRows = 16, kMaxRows = 32, kBlock = 32;

// x's rows go in two groups of at most 16 (one tile each): m0 = min(m, 16) and m1 = m - m0 (0: one group).
// x @ w: tiles 0 and 1 hold group 0's output halves (16 columns each, fp32), 2 group 0's x block; 5, 6 and 7 the
// same for group 1; 3 and 4 w's two halves of a panel block.
// x @ w^T: tiles 0 and 1 hold y^T for two 16-row blocks of w against group 0 (16 x m0 fp32), 5 and 6 against
// group 1; 2 and 3 those blocks of w; 4 and 7 the two groups' x^T blocks.
inline void ConfigureTiles(int64_t m, bool transposed) {
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
// three ways of reordering w: on the fly (Columns), once per call (AmxPack) and once per GEMM call (GemmPanels).
inline void ReorderBlock(const uint16_t* rows, int64_t n, const agentgym::PairInterleave& pairs, uint16_t* out) {
  for (int r = 0; r < 16; ++r) {
    const __m512i even = _mm512_loadu_si512(rows + 2 * r * n), odd = _mm512_loadu_si512(rows + (2 * r + 1) * n);
    _mm512_storeu_si512(out + 32 * r, pairs.Low(even, odd));
    _mm512_storeu_si512(out + 512 + 32 * r, pairs.High(even, odd));
  }
}

struct NoOp {
  void operator()() const {}
};

// The rows of a finished output block still to be written out (SwiGLU, the rounding to bf16, a transposed copy), a
// few at a time between the next block's tile products, so that the vector work runs beside the tiles'. On a 2-core
// Xeon it ran one after the other when it followed them: a prefill's SwiGLU product took twice its products' time.
// write(row) writes one row of the block handed over by the last Start.
struct PendingRows {
  int64_t rows = 0, done = 0;

  void Start(int64_t count) { rows = count, done = 0; }
  template <typename Write>
  void Take(int64_t count, const Write& write) {
    for (const int64_t stop = std::min(rows, done + count); done < stop; ++done) write(done);
  }
  template <typename Write>
  void Finish(const Write& write) {
    Take(rows - done, write);
  }
};

// y[:, 32 p0 : 32 p1] for x [M, K] and w packed by panels: packed[p][kb] holds w[32 kb : 32 kb + 32, 32 p : 32 p + 32]
// as two 16-column halves in the tiles' pair layout ([2][16][16][2], 2 KB), so each panel reads one contiguous
// stream and keeps its output in tiles across all of K. between() runs after each k block's tile products.
template <bool kTwoGroups, typename Between = NoOp>
inline void PackedPanels(const uint16_t* x, const uint16_t* packed, int64_t k_size, int64_t n, int64_t p0, int64_t p1,
                         float* y, const Between& between = Between()) {
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
      between();
    }
    _tile_stored(0, y + p * kBlock, n * 4);
    _tile_stored(1, y + p * kBlock + 16, n * 4);
    if (kTwoGroups) {
      _tile_stored(5, y1 + p * kBlock, n * 4);
      _tile_stored(6, y1 + p * kBlock + 16, n * 4);
    }
  }
}

// Panel p of w [K, N] (k blocks [kb0, kb1)) packed for PackedPanels as panel first + p * every of out: block
// (panel, kb), half h, row r, lane c holds (w[32 kb + 2r, 32 p + 16 h + c], w[32 kb + 2r + 1, 32 p + 16 h + c]).
inline void PackPanels(const uint16_t* w, int64_t k_size, int64_t n, int64_t kb0, int64_t kb1, int64_t first,
                       int64_t every, uint16_t* out) {
  const agentgym::PairInterleave pairs;
  const int64_t k_blocks = k_size / kBlock;
  for (int64_t kb = kb0; kb < kb1; ++kb)
    for (int64_t p = 0; p < n / kBlock; ++p)
      ReorderBlock(w + kb * kBlock * n + p * kBlock, n, pairs, out + ((first + p * every) * k_blocks + kb) * 1024);
}

// rows x 32 bf16 outputs silu(gate) * up from fp32 blocks gate and up (row strides kBlock) into y (row stride n).
inline void StoreSwiGLU(const float* gate, const float* up, int64_t rows, int64_t stride, uint16_t* y, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kBlock; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + c),
                          agentgym::SwiGLU16(_mm512_loadu_ps(gate + r * stride + c),
                                             _mm512_loadu_ps(up + r * stride + c)));
}

}  // namespace amx
}  // namespace agentgym
