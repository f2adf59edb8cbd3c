// Causal attention for long prefill chunks on AMX tiles (the amx build of prefill_attention).
//
// Both halves of the packed cache are already AMX B operands: a key segment [D/2][block_size][2]
// read 16 keys at a time is a B tile of 16 dim-pairs by 16 keys (rows block_size * 4 bytes
// apart), and a value segment [block_size/2][D][2] read 16 dims at a time is a B tile of key
// pairs by 16 dims (rows D * 4 bytes apart). A work item is prefill_attention's (sequence, tile
// of up to 64 query rows, kv head); each query head of the kv head runs the rows in slices of 16
// (one A tile of queries per 32 dims) over the keys 64 at a time: S = Q K^T 16 keys a C tile,
// the online softmax on AVX-512 (fp32, masked per row: causal and sliding window; the 16 rows'
// maxima, corrections and sums side by side), P rounded to bf16 as the AVX-512 kernel rounds it,
// then P V three 16-dim C tiles at a time, added to fp32 accumulators rescaled by the softmax's
// correction. A W2-like prefill (48 prompts of 32-512 tokens, 8 heads of 64) 18.0 -> 13 ms a layer
// on an Intel Xeon with AMX (2 threads).
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
// 5 P (queries x 16 keys, bf16), 6 V (8 key-pairs x 16 dims), 7 O (queries x 16 dims, fp32); P V
// takes 0 and 1 as O tiles too
void configure(int queries) {
  engine_cpu::configure_tiles({{0, queries, 64}, {1, queries, 64}, {2, queries, 64}, {3, queries, 64},
                               {4, 16, 64}, {5, queries, 32}, {6, 8, 64}, {7, queries, 64}});
}

// Lanes 2i and 2i + 1 of one vector, then of the next: fold_rows's permutes
struct RowFold {
  __m512i even, odd;
};

inline RowFold row_fold() {
  alignas(64) int32_t even[16], odd[16];
  for (int i = 0; i < 16; ++i) {
    even[i] = i < 8 ? 2 * i : 16 + 2 * (i - 8);
    odd[i] = even[i] + 1;
  }
  return {_mm512_load_si512(even), _mm512_load_si512(odd)};
}

// v[r] (16 lanes each, r < 16) -> lane r: op over v[r]'s lanes. Each level combines lanes 2i and
// 2i + 1 of two vectors into one holding both (a row's lanes halve, the rows per vector double):
// 15 folds of two permutes and an op, for what 16 horizontal reductions would do
template <typename Op>
__attribute__((always_inline)) inline __m512 fold_rows(__m512 (&v)[16], const RowFold& f, Op op) {
  auto pair = [&](__m512 a, __m512 b) {
    return op(_mm512_permutex2var_ps(a, f.even, b), _mm512_permutex2var_ps(a, f.odd, b));
  };
  __m512 t[8];
  for (int i = 0; i < 8; ++i) t[i] = pair(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) t[i] = pair(t[2 * i], t[2 * i + 1]);
  for (int i = 0; i < 2; ++i) t[i] = pair(t[2 * i], t[2 * i + 1]);
  return pair(t[0], t[1]);
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
  alignas(64) float o[48][16];  // up to three C tiles of P V
  alignas(64) float acc[16][D];
  alignas(64) float m[16], l[16];  // each row's running max and sum (rows past `rows`: -inf and 0)
  for (int r = 0; r < 16; ++r) {  // a sink: the max starts at it, the sum at exp(sink - sink) = 1
    m[r] = sinks && r < rows ? sinks[head] : -std::numeric_limits<float>::infinity();
    l[r] = sinks && r < rows ? 1.f : 0.f;
    if (r < rows)
      for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(&acc[r][d], _mm512_setzero_ps());
  }
  const RowFold fold = row_fold();
  auto max_of = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  auto sum_of = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
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
    // softmax, the 16 rows' maxima, corrections and sums side by side: each row's 16 lane maxima
    // (and sums) are folded with the other rows' (fold_rows) until lane r holds row r's, so one
    // exp512 makes every row's correction. Keys kt + j are allowed for a row at position pos when
    // lo_pos <= kt + j <= pos; the scores are scaled and masked (-inf) in place.
    __mmask16 valid[16][kQuarters];
    __m512 lanes[16];
    for (int r = 0; r < 16; ++r) {
      lanes[r] = neg_inf;
      if (r >= rows) continue;
      const int64_t pos = first_pos + r;
      const int64_t lo_pos = window > 0 ? pos - window + 1 : 0;
      for (int x = 0; x < kQuarters; ++x) {
        const int64_t first = kt + 16 * x;
        const int64_t hi = std::min<int64_t>(15, pos - first), lo_ = std::max<int64_t>(0, lo_pos - first);
        valid[r][x] = x < quarters && hi >= 0 && hi >= lo_ && lo_ <= 15
                          ? static_cast<__mmask16>(((1u << (hi + 1)) - 1) & ~((1u << lo_) - 1))
                          : static_cast<__mmask16>(0);
        const __m512 v =
            _mm512_mask_blend_ps(valid[r][x], neg_inf, _mm512_mul_ps(_mm512_load_ps(&s[r][16 * x]), vscale));
        _mm512_store_ps(&s[r][16 * x], v);
        lanes[r] = _mm512_max_ps(lanes[r], v);
      }
    }
    const __m512 old_max = _mm512_load_ps(m);
    const __m512 new_max = _mm512_max_ps(old_max, fold_rows(lanes, fold, max_of));
    // exp(old - new), and 1 for a row that has met no key yet (its max still -inf)
    const __m512 corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ),
                                             engine_cpu::exp512(_mm512_sub_ps(old_max, new_max)), _mm512_set1_ps(1.f));
    alignas(64) float new_max_of[16], corr_of[16];
    _mm512_store_ps(new_max_of, new_max);
    _mm512_store_ps(corr_of, corr);
    _mm512_store_ps(m, new_max);
    for (int r = 0; r < 16; ++r) {
      lanes[r] = _mm512_setzero_ps();
      if (r >= rows) continue;
      const __m512 nm = _mm512_set1_ps(new_max_of[r]);
      for (int x = 0; x < kQuarters; ++x) {
        const __m512 e =
            _mm512_maskz_mov_ps(valid[r][x], engine_cpu::exp512(_mm512_sub_ps(_mm512_load_ps(&s[r][16 * x]), nm)));
        lanes[r] = _mm512_add_ps(lanes[r], e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&p[r][16 * x]), (__m256i)_mm512_cvtneps_pbh(e));
      }
      if (corr_of[r] != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr_of[r]);
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(&acc[r][d], _mm512_mul_ps(_mm512_load_ps(&acc[r][d]), cv));
      }
    }
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), corr, fold_rows(lanes, fold, sum_of)));
    // acc += P V, 16 dims a C tile, three at a time (tiles 0, 1 and 7: S's are free once the scores
    // are stored): each quarter's P is loaded once for the three, and consecutive products go to
    // different C tiles, none waiting on the one before
    const int64_t v_bytes = D * 4;
    for (int64_t b0 = 0; b0 < kBlocks; b0 += 3) {
      const int64_t nb = std::min<int64_t>(3, kBlocks - b0);
      _tile_zero(0);
      if (nb > 1) _tile_zero(1);
      if (nb > 2) _tile_zero(7);
      for (int x = 0; x < quarters; ++x) {
        _tile_loadd(5, &p[0][16 * x], kKeyTile * sizeof(uint16_t));
        _tile_loadd(6, vw[x] + 32 * b0, v_bytes);
        _tile_dpbf16ps(0, 5, 6);
        if (nb > 1) {
          _tile_loadd(6, vw[x] + 32 * (b0 + 1), v_bytes);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (nb > 2) {
          _tile_loadd(6, vw[x] + 32 * (b0 + 2), v_bytes);
          _tile_dpbf16ps(7, 5, 6);
        }
      }
      _tile_stored(0, &o[0][0], 16 * sizeof(float));
      if (nb > 1) _tile_stored(1, &o[16][0], 16 * sizeof(float));
      if (nb > 2) _tile_stored(7, &o[32][0], 16 * sizeof(float));
      for (int64_t j = 0; j < nb; ++j)
        for (int r = 0; r < rows; ++r)
          _mm512_store_ps(&acc[r][16 * (b0 + j)],
                          _mm512_add_ps(_mm512_load_ps(&acc[r][16 * (b0 + j)]), _mm512_load_ps(&o[16 * j + r][0])));
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
