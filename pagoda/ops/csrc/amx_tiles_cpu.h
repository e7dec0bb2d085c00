// AMX tile state both CPU extensions' AMX kernels use (quant_cpu.cpp: q_linear_amx;
// paged_prefill_amx_cpu.cpp: prefill attention): every tile 16 rows x 64 bytes. Included
// only where the build has AMX-TILE; a caller runs it only once the process was granted
// the tile state (arch_prctl), since a tile instruction would fault otherwise.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagoda_amx {

// LDTILECFG's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures tiles 0-7 of the calling thread as 16 rows x 64 bytes (a bf16 A or B tile,
// or a 16 x 16 float32 accumulator); each thread of a region calls it, then _tile_release.
inline void load_full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // NOTE: GCC does not see LDTILECFG's builtin read its operand: once this function was
  // inlined, the stores above were dropped as dead and LDTILECFG faulted on the garbage
  // left there (#GP, seen as SIGSEGV). The empty asm takes the address and clobbers
  // memory, so the stores must be made first.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace pagoda_amx
