// Intel AMX set-up shared by the AMX kernels: the OS permission and a tile configuration.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace agentgym {

// Linux hands out the AMX tile state only to processes that ask for it once; true when granted.
inline bool AmxGranted() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// The 64-byte operand of ldtilecfg (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  void Set(int tile, int64_t tile_rows, int64_t bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    bytes_per_row[tile] = static_cast<uint16_t>(bytes);
  }
};

// Interleaves two rows of 32 bf16 (even and odd k) into the tiles' pair layout: Low() holds columns 0-15 as
// (even[c], odd[c]) pairs, High() columns 16-31.
struct PairInterleave {
  __m512i low, high;

  PairInterleave() {
    alignas(64) uint16_t pick_low[32], pick_high[32];
    for (int c = 0; c < 16; ++c) {
      pick_low[2 * c] = c, pick_low[2 * c + 1] = 32 + c;
      pick_high[2 * c] = 16 + c, pick_high[2 * c + 1] = 48 + c;
    }
    low = _mm512_load_si512(pick_low);
    high = _mm512_load_si512(pick_high);
  }
  __m512i Low(__m512i even, __m512i odd) const { return _mm512_permutex2var_epi16(even, low, odd); }
  __m512i High(__m512i even, __m512i odd) const { return _mm512_permutex2var_epi16(even, high, odd); }
};

}  // namespace agentgym
