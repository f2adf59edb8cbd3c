// What the AMX kernels share: the tile configuration (palette 1) and loading one.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define ENGINE_CPU_AMX 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace engine_cpu {

// one tile's shape: rows, and bytes a row (at most 16 and 64)
struct TileShape {
  int tile, rows, bytes;
};

// ldtilecfg with the given tiles' shapes (the others unconfigured); it zeroes every tile
inline void configure_tiles(std::initializer_list<TileShape> shapes) {
  struct alignas(64) {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (const TileShape& s : shapes) {
    config.rows[s.tile] = static_cast<uint8_t>(s.rows);
    config.colsb[s.tile] = static_cast<uint16_t>(s.bytes);
  }
  // GCC does not count ldtilecfg as reading the configuration: without this its dead-store
  // elimination can drop the shapes written above (seen with configure() out of line)
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace engine_cpu
#endif
