// AMX tile configuration shared by the kernels that run on tiles (flash_prefill.cpp,
// amx_linear.cpp, decode_fused.cpp): the 64-byte LDTILECFG operand and its load.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

namespace yuebing {

// Palette 1: per tile register its rows and the bytes of a row (unused registers stay 0).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every register in `regs` as rows × 64 bytes.
inline void set_tiles(TileConfig& cfg, std::initializer_list<int> regs, int rows) {
  for (int t : regs) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
}

// Loads cfg into this thread's tile state. GCC does not treat LDTILECFG as reading cfg: without
// the barrier it moved the stores to cfg after the load once a caller was inlined (a zero
// config, then a fault).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace yuebing
#endif
