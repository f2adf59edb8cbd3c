// Causal attention for long prefill chunks on AMX tiles (the amx build of prefill_attention).
//
// Both halves of the packed cache are already AMX B operands: a key segment [D/2][block_size][2]
// read 16 keys at a time is a B tile of 16 dim-pairs by 16 keys (rows block_size * 4 bytes
// apart), and a value segment [block_size/2][D][2] read 16 dims at a time is a B tile of key
// pairs by 16 dims (rows D * 4 bytes apart). A work item is prefill_attention's (sequence, tile
// of up to 64 query rows, kv head); each query head of the kv head runs the rows in slices of 16
// (one A tile of queries per 32 dims) over the keys 64 at a time: S = Q K^T 16 keys a C tile,
// the online softmax on AVX-512 (fp32, masked per row: causal and sliding window), P rounded to
// bf16 as the AVX-512 kernel rounds it, then P V one 16-dim C tile at a time, added to fp32
// accumulators rescaled by the softmax's correction.
#include "kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "amx.h"

#if defined(ENGINE_CPU_AMX)
#include "vec.h"
#endif

bool amx_supported();  // amx_linear.cpp: an AMX build the OS lets use the tiles

// whether amx_prefill_item runs this head size here
bool amx_attention_supported(int64_t head_size) {
#if defined(ENGINE_CPU_AMX)
  return amx_supported() && (head_size == 32 || head_size == 64 || head_size == 128 || head_size == 256);
#else
  (void)head_size;
  return false;
#endif
}

#if defined(ENGINE_CPU_AMX)
namespace {

constexpr int64_t kKeyTile = 64;  // keys per step: four 16-key quarters (S tiles 0 and 1 in turn)
constexpr int kQuarters = kKeyTile / 16;

// tiles: 0-1 S (queries x 16 keys, fp32), 2-3 Q (queries x 32 dims), 4 K (16 dim-pairs x 16 keys),
// 5 P (queries x 16 keys, bf16), 6 V (8 key-pairs x 16 dims), 7 O (queries x 16 dims, fp32)
void configure(int queries) {
  engine_cpu::configure_tiles({{0, queries, 64}, {1, queries, 64}, {2, queries, 64}, {3, queries, 64},
                               {4, 16, 64}, {5, queries, 32}, {6, 8, 64}, {7, queries, 64}});
}

// one query head's rows [q_start, q_start + rows) (rows <= 16) at positions first_pos.. over its
// kv head's keys; out rows [T, H, D]
template <int D>
void slice(at::BFloat16* out, const at::BFloat16* q, int64_t q_row, const at::BFloat16* key_cache,
           const at::BFloat16* value_cache, const int64_t* table, int64_t q_start, int rows, int64_t first_pos,
           int64_t head, int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
           int64_t window, const float* sinks) {
  constexpr int64_t kSteps = D / 32;  // Q K^T tile products per 16 keys
  constexpr int64_t kBlocks = D / 16;  // P V output tiles
  const int64_t seg = block_size * D;
  const int64_t row_last = first_pos + rows - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k0 = lo - lo % kKeyTile;
  alignas(64) float s[16][kKeyTile];
  alignas(64) uint16_t p[16][kKeyTile];
  alignas(64) float o[16][16];
  alignas(64) float acc[16][D];
  float m[16], l[16];
  for (int r = 0; r < rows; ++r) {  // a sink: the max starts at it, the sum at exp(sink - sink) = 1
    m[r] = sinks ? sinks[head] : -std::numeric_limits<float>::infinity();
    l[r] = sinks ? 1.f : 0.f;
    for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(&acc[r][d], _mm512_setzero_ps());
  }
  const at::BFloat16* qs = q + q_start * q_row + head * D;
  const int64_t q_bytes = q_row * static_cast<int64_t>(sizeof(at::BFloat16));
  if (kSteps <= 2) {  // the queries stay in tiles 2-3 for every key
    _tile_loadd(2, qs, q_bytes);
    if (kSteps == 2) _tile_loadd(3, qs + 32, q_bytes);
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t kt = k0; kt <= row_last; kt += kKeyTile) {
    // the 16-key quarters (each inside one block) up to the last row's position; later ones are
    // neither read (their blocks may not be allocated yet) nor used
    const int quarters = static_cast<int>(std::min<int64_t>(kQuarters, (row_last - kt) / 16 + 1));
    const at::BFloat16* kw[kQuarters];
    const at::BFloat16* vw[kQuarters];
    for (int x = 0; x < quarters; ++x) {
      const int64_t key = kt + 16 * x;
      const int64_t base = (table[key / block_size] * num_kv_heads + g) * seg;
      kw[x] = key_cache + base + (key % block_size) * 2;
      vw[x] = value_cache + base + (key % block_size / 2) * D * 2;
    }
    const int64_t k_bytes = block_size * 4;
    // quarter X's scores through S tile H (immediates: GCC's tile intrinsics paste their tile
    // numbers into the asm)
#define ENGINE_CPU_SCORES(X, H)                                              \
  do {                                                                      \
    _tile_zero(H);                                                          \
    for (int64_t c = 0; c < kSteps; ++c) {                                  \
      if (kSteps > 2) _tile_loadd(2, qs + 32 * c, q_bytes);                 \
      _tile_loadd(4, kw[X] + 16 * c * block_size * 2, k_bytes);             \
      if (kSteps > 2 || c == 0)                                             \
        _tile_dpbf16ps(H, 2, 4);                                            \
      else                                                                  \
        _tile_dpbf16ps(H, 3, 4);                                            \
    }                                                                       \
    _tile_stored(H, &s[0][16 * (X)], kKeyTile * sizeof(float));             \
  } while (0)
    ENGINE_CPU_SCORES(0, 0);
    if (quarters > 1) ENGINE_CPU_SCORES(1, 1);
    if (quarters > 2) ENGINE_CPU_SCORES(2, 0);
    if (quarters > 3) ENGINE_CPU_SCORES(3, 1);
#undef ENGINE_CPU_SCORES
    // softmax: keys kt + j allowed for a row at position pos when lo_pos <= kt + j <= pos
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r;
      const int64_t lo_pos = window > 0 ? pos - window + 1 : 0;
      __m512 v[kQuarters];
      __mmask16 valid[kQuarters];
      __m512 vmax = neg_inf;
      __mmask16 any_valid = 0;
      for (int x = 0; x < kQuarters; ++x) {
        const int64_t first = kt + 16 * x;
        const int64_t hi = std::min<int64_t>(15, pos - first), lo_ = std::max<int64_t>(0, lo_pos - first);
        valid[x] = x < quarters && hi >= 0 && hi >= lo_ && lo_ <= 15
                       ? static_cast<__mmask16>(((1u << (hi + 1)) - 1) & ~((1u << lo_) - 1))
                       : static_cast<__mmask16>(0);
        any_valid |= valid[x];
        v[x] = _mm512_mask_blend_ps(valid[x], neg_inf, _mm512_mul_ps(_mm512_load_ps(&s[r][16 * x]), vscale));
        vmax = _mm512_max_ps(vmax, v[x]);
      }
      const bool any = any_valid != 0;
      const float tile_max = any ? _mm512_reduce_max_ps(vmax) : -std::numeric_limits<float>::infinity();
      const float new_max = std::max(m[r], tile_max);
      const float corr = new_max == -std::numeric_limits<float>::infinity() ? 1.f : std::exp(m[r] - new_max);
      const __m512 nm = _mm512_set1_ps(new_max);
      __m512 vsum = _mm512_setzero_ps();
      for (int x = 0; x < kQuarters; ++x) {
        const __m512 e = _mm512_maskz_mov_ps(valid[x], engine_cpu::exp512(_mm512_sub_ps(v[x], nm)));
        vsum = _mm512_add_ps(vsum, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&p[r][16 * x]), (__m256i)_mm512_cvtneps_pbh(e));
      }
      l[r] = l[r] * corr + (any ? _mm512_reduce_add_ps(vsum) : 0.f);
      m[r] = new_max;
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(&acc[r][d], _mm512_mul_ps(_mm512_load_ps(&acc[r][d]), cv));
      }
    }
    // acc += P V, 16 dims at a time
    const int64_t v_bytes = D * 4;
    for (int64_t b = 0; b < kBlocks; ++b) {
      _tile_zero(7);
      for (int x = 0; x < quarters; ++x) {
        _tile_loadd(5, &p[0][16 * x], kKeyTile * sizeof(uint16_t));
        _tile_loadd(6, vw[x] + 32 * b, v_bytes);
        _tile_dpbf16ps(7, 5, 6);
      }
      _tile_stored(7, &o[0][0], 16 * sizeof(float));
      for (int r = 0; r < rows; ++r)
        _mm512_store_ps(&acc[r][16 * b], _mm512_add_ps(_mm512_load_ps(&acc[r][16 * b]), _mm512_load_ps(&o[r][0])));
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    at::BFloat16* orow = out + ((q_start + r) * num_heads + head) * D;
    for (int64_t d = 0; d < D; d += 16) engine_cpu::store_bf16(orow + d, _mm512_mul_ps(_mm512_load_ps(&acc[r][d]), inv));
  }
}

}  // namespace
#endif

// prefill_attention's work item on AMX: the query heads of kv head g for query rows
// [q_start, q_start + rows) at positions first_pos.., in slices of 16 rows
void amx_prefill_item(at::BFloat16* out, const at::BFloat16* q, int64_t q_row, const at::BFloat16* key_cache,
                      const at::BFloat16* value_cache, const int64_t* table, int64_t q_start, int64_t rows,
                      int64_t first_pos, int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, float scale, int64_t window, const float* sinks) {
#if defined(ENGINE_CPU_AMX)
  const int64_t group = num_heads / num_kv_heads;
  int configured = -1;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, rows - r0));
    if (n != configured) {
      configure(n);
      configured = n;
    }
    for (int64_t head = g * group; head < (g + 1) * group; ++head) {
      // (amx_attention_supported leaves head size 16, which with_head_size also instantiates, out)
      engine_cpu::with_head_size(head_size, [&](auto d) {
        slice<decltype(d)::value>(out, q, q_row, key_cache, value_cache, table, q_start + r0, n, first_pos + r0,
                                  head, g, num_heads, num_kv_heads, block_size, scale, window, sinks);
      });
    }
  }
#else
  (void)out, (void)q, (void)q_row, (void)key_cache, (void)value_cache, (void)table, (void)q_start, (void)rows;
  (void)first_pos, (void)g, (void)num_heads, (void)num_kv_heads, (void)head_size, (void)block_size, (void)scale;
  (void)window, (void)sinks;
  TORCH_CHECK(false, "amx_prefill_item: not an AMX build");
#endif
}
