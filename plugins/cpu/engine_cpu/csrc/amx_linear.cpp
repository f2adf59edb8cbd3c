// bf16 products of rows of activations with a weight on AMX tiles (Intel Sapphire Rapids and
// later): decode steps of a few dozen rows, the LM head, prefill chunks.
//
// The weight is the one gemv streams, packed [N/16][K/2][16][2]: 16 consecutive k-pairs of one
// block are exactly an AMX B tile (16 rows of 64 bytes: two k of 16 columns), so both kernels
// share one copy. A tile product C[16 x 16] += A[16 x 32] B[32 x 16] takes 16 cycles; the tiles
// are used as 2 x 2 blocks of C (two 16-row slices of x by two 16-column blocks of the weight),
// with two A and two B tiles, all eight tiles. Work goes by pairs of column blocks, each
// thread a contiguous range of them (one weight stream); for each pair every 32-row slice of
// x is run while the pair's weights stay in L1/L2, and x is taken in sweeps that stay in L2
// (chunk_rows). The first pass over a pair prefetches (into L2) each block's next B tile, 1 KB on,
// crossing into the next pair's block at the end: the hardware prefetchers stop at 4 KB pages,
// and this short software stream reads cold weights faster than they do alone or than a whole
// pair prefetched ahead (8 layers of llama58m at 64 rows, weights from memory: 3.3 -> 3.0 ms,
// LM head 1.9-2.0 -> 1.8 ms; farther ahead, 2-8 KB, and T0 hints are slower; Intel Xeon AMX).
// From kPanelRows rows on (prefill chunks) the order turns around: each thread takes its pairs
// a panel at a time (about kPanelBytes of weights, which stay in L2) and runs every 32-row slice
// of x over the panel before the next, so a slice's A tiles stay in L1 and its output rows are
// written a panel's width at a time (2048 x 2816 x 512, Intel Xeon AMX: 1.3-1.4 -> 2.0-2.3
// TFLOP/s, oneDNN 1.5-1.9; at 64 rows and below the two orders run alike).
// A K that is not a multiple of 32 ends with its last k-pairs on AVX512-BF16.
// Greedy picks (an LM head whose outputs only feed argmax) fold each block into per-row bests
// instead of storing it (amx_linear_argmax), or first rule out most columns on an int8 copy of
// the weight with int8 tiles (amx_linear_argmax_screened, below run_amx).
#include "kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "packed_weight.h"
#include "vec.h"

#if defined(ENGINE_CPU_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(ENGINE_CPU_AMX)
namespace {

constexpr int64_t kCols = 16;        // output columns per block (one B tile's width)
constexpr int64_t kStepPairs = 16;   // k-pairs per tile product (32 k)
// rows of x per sweep over the blocks: as many 32-row passes as keep x within kChunkBytes of L2
constexpr int64_t kChunkBytes = 768 * 1024;
inline int64_t chunk_rows(int64_t K) {
  return std::clamp<int64_t>(kChunkBytes / (K * 2) / 32 * 32, 32, 1024);
}
// prefill order: from this many rows, panels of block pairs holding about kPanelBytes of weights
constexpr int64_t kPanelRows = 128;
constexpr int64_t kPanelBytes = 1024 * 1024;

// Linux keeps the 8 KB of tile data out of a process's saved state until it asks for it
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

bool tiles_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// tiles 0-3 C (C[i][j] is tile 2i+j), 4-5 A (slices 0 and 1), 6-7 B (blocks 0 and 1);
// rows0 / rows1: x rows in the two slices (rows1 may be 0: its tiles are left unconfigured)
void configure(int rows0, int rows1) {
  constexpr int c = kCols * sizeof(float), a = 2 * kStepPairs * sizeof(at::BFloat16);
  constexpr int b = kCols * 2 * sizeof(at::BFloat16);
  if (rows1 > 0)
    engine_cpu::configure_tiles({{0, rows0, c}, {1, rows0, c}, {2, rows1, c}, {3, rows1, c}, {4, rows0, a},
                                 {5, rows1, a}, {6, kStepPairs, b}, {7, kStepPairs, b}});
  else
    engine_cpu::configure_tiles({{0, rows0, c}, {1, rows0, c}, {4, rows0, a}, {6, kStepPairs, b}, {7, kStepPairs, b}});
}

using engine_cpu::bias_of;
using engine_cpu::columns_mask;

// one row's 16 sums of a block (fp32) plus the bias and the k-pairs from `tail_from` to `pairs`
// (of x_row and the block w) on AVX512-BF16: what every finish rounds
inline __m512 finished_sums(const float* sums_row, __m512 bias_v, const at::BFloat16* x_row, const at::BFloat16* w,
                            int64_t tail_from, int64_t pairs) {
  __m512 acc = _mm512_add_ps(_mm512_loadu_ps(sums_row), bias_v);
  for (int64_t p = tail_from; p < pairs; ++p) {
    int32_t xpair;
    std::memcpy(&xpair, x_row + p * 2, sizeof(xpair));
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * 2 * kCols);
    acc = _mm512_dpbf16_ps(acc, wv, (__m512bh)_mm512_set1_epi32(xpair));
  }
  return acc;
}

// 16 fp32 values as rounded to bf16 (nearest even) and read back
inline __m512 bf16_rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// sums [rows][16] (fp32, row stride 16) of one block, plus the k-pairs from `tail_from` to `pairs`
// on AVX512-BF16 and the bias, rounded to bf16 (nearest even) into out's block columns
void finish_block(const float* sums, int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w,
                  int64_t tail_from, int64_t pairs, const at::BFloat16* bias, int64_t n0, int64_t N,
                  at::BFloat16* out, int64_t out_stride) {
  const __mmask16 mask = columns_mask(n0, N);
  if (mask == 0) return;
  const __m512 bias_v = bias_of(bias, n0, mask);
  for (int m = 0; m < rows; ++m) {
    const __m512 acc = finished_sums(sums + m * kCols, bias_v, x + m * x_stride, w, tail_from, pairs);
    _mm256_mask_storeu_epi16(out + m * out_stride + n0, mask, (__m256i)_mm512_cvtneps_pbh(acc));
  }
}

// a gated MLP's 16 columns: gate and up sums (fp32, row stride 16) finished as finish_block
// finishes each (tail, bias, rounded to bf16), then silu(gate) * up as silu_and_mul computes it
void finish_gated(const float* gate_sums, const float* up_sums, int rows, const at::BFloat16* x, int64_t x_stride,
                  const at::BFloat16* wg, const at::BFloat16* wu, int64_t tail_from, int64_t pairs,
                  const at::BFloat16* bias, int64_t n0, int64_t half, at::BFloat16* out, int64_t out_stride) {
  const __m512 bias_g = bias_of(bias, n0, 0xffff), bias_u = bias_of(bias, half + n0, 0xffff);
  for (int m = 0; m < rows; ++m) {
    const __m512 g = finished_sums(gate_sums + m * kCols, bias_g, x + m * x_stride, wg, tail_from, pairs);
    const __m512 u = finished_sums(up_sums + m * kCols, bias_u, x + m * x_stride, wu, tail_from, pairs);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + n0),
                        (__m256i)_mm512_cvtneps_pbh(engine_cpu::silu_mul(bf16_rounded(g), bf16_rounded(u))));
  }
}

// one row's greedy pick over the columns seen so far: the largest output (as rounded to bf16)
// and its first column, and the first column holding a NaN (-1: none), as argmax counts them.
// Columns may be seen in any order.
struct RowBest {
  float value;
  int64_t index, nan_index;
  void take(float v, int64_t column) {
    if (v > value || (v == value && column < index)) value = v, index = column;
  }
  void take_nan(int64_t column) {
    if (nan_index < 0 || column < nan_index) nan_index = column;
  }
};

// 16 columns' sums finished as finish_block finishes them (tail, bias, bf16 rounding), folded into
// each row's RowBest instead of stored: lane i (of mask) is column cols[i] (increasing with i), or
// n0 + i without cols.
void fold_picks(const float* sums, int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w,
                int64_t tail_from, int64_t pairs, __m512 bias_v, __mmask16 mask, int64_t n0, const int32_t* cols,
                RowBest* best) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto column = [&](int lane) { return cols != nullptr ? static_cast<int64_t>(cols[lane]) : n0 + lane; };
  for (int m = 0; m < rows; ++m) {
    const __m512 v = bf16_rounded(finished_sums(sums + m * kCols, bias_v, x + m * x_stride, w, tail_from, pairs));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & mask;
    if (nan) best[m].take_nan(column(__builtin_ctz(nan)));
    const __m512 valid = _mm512_mask_blend_ps(mask & ~nan, neg_inf, v);
    const float block_max = _mm512_reduce_max_ps(valid);
    if (block_max >= best[m].value)
      best[m].take(block_max,
                   column(__builtin_ctz(_mm512_cmp_ps_mask(valid, _mm512_set1_ps(block_max), _CMP_EQ_OQ) & mask)));
  }
}

// the block of columns [n0, n0 + 16) folded by fold_picks
void finish_argmax(const float* sums, int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w,
                   int64_t tail_from, int64_t pairs, const at::BFloat16* bias, int64_t n0, int64_t N, RowBest* best) {
  const __mmask16 mask = columns_mask(n0, N);
  if (mask == 0) return;
  fold_picks(sums, rows, x, x_stride, w, tail_from, pairs, bias_of(bias, n0, mask), mask, n0, nullptr, best);
}

// the 16 lines of B tile `elem` elements into block w's stream, past its end (block_elems) the
// same place in the next pair's block, into L2
template <typename T>
inline void prefetch_tile(const T* w, int64_t elem, int64_t block_elems) {
  const char* p = reinterpret_cast<const char*>(elem < block_elems ? w + elem : w + block_elems + elem);
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
}

// C tile c += A tile a times B tile b: bf16 pairs summed in fp32, or int8 quads in int32 (a macro:
// the tile intrinsics take their tile numbers as literals)
#define ENGINE_CPU_TILE_DOT(T, c, a, b)      \
  do {                                       \
    if constexpr (std::is_same_v<T, int8_t>) \
      _tile_dpbssd(c, a, b);                 \
    else                                     \
      _tile_dpbf16ps(c, a, b);               \
  } while (0)

// one pass: rows [m0, m0 + rows0 + rows1) of x (rows0 <= 16 in slice 0, rows1 <= 16 in slice 1)
// over blocks g and g + 1 (one of them without kTwoBlocks), the C tiles summed over the whole
// multiple of 64 bytes of K; the first pass over the blocks (kFirst) prefetches their next B tiles.
// T is bf16 (fp32 sums, 32 k a tile product) or int8 (the screening's int32 sums, 64 k); a tile
// row is 64 bytes of either, so the layouts and strides in bytes are the same.
template <bool kTwoSlices, bool kTwoBlocks, bool kFirst, typename T = at::BFloat16>
inline void tile_pass(const T* x, int64_t x_stride, const T* w0, const T* w1, int64_t steps, int64_t block_elems,
                      float (*sums)[16 * kCols]) {
  constexpr int64_t kStepK = 64 / sizeof(T);
  const int64_t x_bytes = x_stride * sizeof(T);
  constexpr int64_t w_bytes = 64;
  _tile_zero(0);
  if (kTwoBlocks) _tile_zero(1);
  if (kTwoSlices) {
    _tile_zero(2);
    if (kTwoBlocks) _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k0 = s * kStepK;
    if (kFirst) {
      prefetch_tile(w0, (k0 + kStepK) * kCols, block_elems);
      if (kTwoBlocks) prefetch_tile(w1, (k0 + kStepK) * kCols, block_elems);
    }
    _tile_loadd(4, x + k0, x_bytes);
    _tile_loadd(6, w0 + k0 * kCols, w_bytes);
    ENGINE_CPU_TILE_DOT(T, 0, 4, 6);
    if (kTwoSlices) {
      _tile_loadd(5, x + 16 * x_stride + k0, x_bytes);
      ENGINE_CPU_TILE_DOT(T, 2, 5, 6);
    }
    if (kTwoBlocks) {
      _tile_loadd(7, w1 + k0 * kCols, w_bytes);
      ENGINE_CPU_TILE_DOT(T, 1, 4, 7);
      if (kTwoSlices) ENGINE_CPU_TILE_DOT(T, 3, 5, 7);
    }
  }
  const int64_t c_bytes = kCols * sizeof(float);
  _tile_stored(0, sums[0], c_bytes);
  if (kTwoBlocks) _tile_stored(1, sums[1], c_bytes);
  if (kTwoSlices) {
    _tile_stored(2, sums[2], c_bytes);
    if (kTwoBlocks) _tile_stored(3, sums[3], c_bytes);
  }
}

// tile_pass for the pass's shape: two 16-row slices or one, two blocks or one, first or not
template <typename T>
inline void dispatch_pass(bool two_slices, bool two_blocks, bool first, const T* x, int64_t x_stride, const T* w0,
                          const T* w1, int64_t steps, int64_t block_elems, float (*sums)[16 * kCols]) {
  auto pass = [&](auto slices, auto blocks, auto is_first) {
    tile_pass<decltype(slices)::value, decltype(blocks)::value, decltype(is_first)::value>(x, x_stride, w0, w1, steps,
                                                                                             block_elems, sums);
  };
  auto with_first = [&](auto slices, auto blocks) {
    first ? pass(slices, blocks, std::true_type{}) : pass(slices, blocks, std::false_type{});
  };
  auto with_blocks = [&](auto slices) {
    two_blocks ? with_first(slices, std::true_type{}) : with_first(slices, std::false_type{});
  };
  two_slices ? with_blocks(std::true_type{}) : with_blocks(std::false_type{});
}

// configure() unless the tiles already have this shape
inline void configure_once(int rows0, int rows1, int& configured0, int& configured1) {
  if (rows0 == configured0 && rows1 == configured1) return;
  configure(rows0, rows1);
  configured0 = rows0;
  configured1 = rows1;
}

// blocks [b0, b1) of the output columns for M rows of x (one sweep: M <= chunk_rows(K)); with
// cold, the first pass over each pair prefetches its weights' next tiles
// Gated (half > 0: the weight is a gated MLP's gate and up, half columns each, half % 16 == 0):
// [b0, b1) are blocks of the gate, each run with its up block (half / 16 on), and out gets
// silu(gate) * up, half columns.
void amx_blocks(const at::BFloat16* x, int64_t x_stride, int64_t M, const at::BFloat16* packed,
                const at::BFloat16* bias, at::BFloat16* out, int64_t out_stride, int64_t N, int64_t K, int64_t b0,
                int64_t b1, bool cold, int64_t half = 0, RowBest* best = nullptr) {
  const int64_t pairs = K / 2;
  const int64_t steps = pairs / kStepPairs;
  const int64_t tail_from = steps * kStepPairs;
  alignas(64) float sums[4][16 * kCols];
  int configured0 = -1, configured1 = -1;
  const int64_t block_elems = pairs * 2 * kCols;
  for (int64_t g = b0; g < b1; g += half > 0 ? 1 : 2) {
    const bool two_blocks = half > 0 || g + 1 < b1;
    const at::BFloat16* w0 = packed + g * block_elems;
    const at::BFloat16* w1 = w0 + (half > 0 ? half / kCols : 1) * block_elems;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m0));
      const int rows1 = static_cast<int>(std::clamp<int64_t>(M - m0 - 16, 0, 16));
      configure_once(rows0, rows1, configured0, configured1);
      const at::BFloat16* xs = x + m0 * x_stride;
      if (steps > 0)
        dispatch_pass(rows1 > 0, two_blocks, cold && m0 == 0, xs, x_stride, w0, w1, steps, block_elems, sums);
      else
        std::memset(sums, 0, sizeof(sums));
      at::BFloat16* os = out + m0 * out_stride;
      if (best != nullptr) {  // greedy picks: no outputs stored
        finish_argmax(sums[0], rows0, xs, x_stride, w0, tail_from, pairs, bias, g * kCols, N, best + m0);
        if (two_blocks)
          finish_argmax(sums[1], rows0, xs, x_stride, w1, tail_from, pairs, bias, (g + 1) * kCols, N, best + m0);
        if (rows1 > 0) {
          const at::BFloat16* xs1 = xs + 16 * x_stride;
          finish_argmax(sums[2], rows1, xs1, x_stride, w0, tail_from, pairs, bias, g * kCols, N, best + m0 + 16);
          if (two_blocks)
            finish_argmax(sums[3], rows1, xs1, x_stride, w1, tail_from, pairs, bias, (g + 1) * kCols, N,
                          best + m0 + 16);
        }
        continue;
      }
      if (half > 0) {
        finish_gated(sums[0], sums[1], rows0, xs, x_stride, w0, w1, tail_from, pairs, bias, g * kCols, half, os,
                     out_stride);
        if (rows1 > 0)
          finish_gated(sums[2], sums[3], rows1, xs + 16 * x_stride, x_stride, w0, w1, tail_from, pairs, bias,
                       g * kCols, half, os + 16 * out_stride, out_stride);
        continue;
      }
      finish_block(sums[0], rows0, xs, x_stride, w0, tail_from, pairs, bias, g * kCols, N, os, out_stride);
      if (two_blocks)
        finish_block(sums[1], rows0, xs, x_stride, w1, tail_from, pairs, bias, (g + 1) * kCols, N, os, out_stride);
      if (rows1 > 0) {
        const at::BFloat16* xs1 = xs + 16 * x_stride;
        at::BFloat16* os1 = os + 16 * out_stride;
        finish_block(sums[2], rows1, xs1, x_stride, w0, tail_from, pairs, bias, g * kCols, N, os1, out_stride);
        if (two_blocks)
          finish_block(sums[3], rows1, xs1, x_stride, w1, tail_from, pairs, bias, (g + 1) * kCols, N, os1,
                       out_stride);
      }
    }
  }
}

}  // namespace
#endif

// whether amx_linear runs here: an AMX build, and the OS lets this process use the tiles
bool amx_supported() {
#if defined(ENGINE_CPU_AMX)
  return tiles_permitted();
#else
  return false;
#endif
}

namespace {

#if defined(ENGINE_CPU_AMX)
// RowBest of each row, one vector for each range of the columns
using RangePicks = std::vector<std::vector<RowBest>>;

// each row's pick over all ranges (the first NaN counts as the largest)
void merge_picks(const RangePicks& found, int64_t M, int64_t* picks) {
  for (int64_t m = 0; m < M; ++m) {
    RowBest row{-std::numeric_limits<float>::infinity(), std::numeric_limits<int64_t>::max(), -1};
    for (const std::vector<RowBest>& range : found) {
      if (range[m].nan_index >= 0) row.take_nan(range[m].nan_index);
      row.take(range[m].value, range[m].index);
    }
    picks[m] = row.nan_index >= 0 ? row.nan_index : row.index;
  }
}

// out = x @ W^T + bias (half == 0), or silu(gate) * up of a gated MLP's weight (half > 0): the
// threads take contiguous ranges of block pairs (one weight stream each)
// With picks (M entries): out is not written; each row's greedy pick over all N columns goes there.
void run_amx(at::BFloat16* op, int64_t os, const at::BFloat16* xp, int64_t xs, int64_t M, int64_t K,
             const at::BFloat16* wp, int64_t blocks, const at::BFloat16* bp, int64_t N, int64_t half,
             int64_t* picks = nullptr) {
  const int64_t units = half > 0 ? half / kCols : (blocks + 1) / 2;  // gate blocks, or block pairs
  const int64_t per_unit = half > 0 ? 1 : 2;                          // blocks a unit starts apart
  std::mutex found_lock;
  RangePicks found;
  at::parallel_for(0, units, half > 0 ? 16 : 8, [&](int64_t u0, int64_t u1) {
    const int64_t b0 = per_unit * u0, b1 = half > 0 ? u1 : std::min(blocks, 2 * u1);
    std::vector<RowBest> best_store;
    RowBest* best = nullptr;
    if (picks != nullptr) {
      best_store.assign(M, RowBest{-std::numeric_limits<float>::infinity(), b0 * kCols, -1});
      best = best_store.data();
    }
    if (M >= kPanelRows) {
      const int64_t pair_bytes = 2 * K * kCols * static_cast<int64_t>(sizeof(at::BFloat16));
      const int64_t panel = per_unit * std::max<int64_t>(1, kPanelBytes / pair_bytes);  // in blocks
      for (int64_t q0 = b0; q0 < b1; q0 += panel)
        for (int64_t m0 = 0; m0 < M; m0 += 32)
          amx_blocks(xp + m0 * xs, xs, std::min<int64_t>(32, M - m0), wp, bp, op + m0 * os, os, N, K, q0,
                     std::min(b1, q0 + panel), m0 == 0, half, best ? best + m0 : nullptr);
    } else {
      const int64_t chunk = chunk_rows(K);
      for (int64_t m0 = 0; m0 < M; m0 += chunk)
        amx_blocks(xp + m0 * xs, xs, std::min(chunk, M - m0), wp, bp, op + m0 * os, os, N, K, b0, b1, true, half,
                   best ? best + m0 : nullptr);
    }
    if (best != nullptr) {
      std::lock_guard<std::mutex> guard(found_lock);
      found.push_back(std::move(best_store));
    }
  });
  if (picks != nullptr) merge_picks(found, M, picks);
}

// ---- Greedy picks screened on an int8 copy of the weight ----
// The weight's int8 copy: q = round(w / s) for each output column n, s = max|w_n| / 127, packed
// [ceil(N/16)][K/4][16][4] (an int8 B tile: 16 rows of 4 k of 16 columns), and Q1[n] = sum |q|.
// A row h of x is rounded the same way (t = max|h| / 127, int8 p). With w' = s q and h' = t p
// (|w - w'| <= s/2 and |h - h'| <= t/2 elementwise),
//   |w.h - w'.h'| <= sum |w - w'| |h| + sum |w'| |h - h'| <= s (|h|_1 / 2 + t Q1 / 2),
// and w'.h' = s t (q.p) with q.p exact in int32 (TDPBSSD). amx_linear's fp32 sums differ from w.h by
// at most about K 2^-24 sum |w h| <= K 2^-24 127 s |h|_1 (order of the sums, rounding of pairs);
// the bound allows four times that (kSumSlack), which also covers the fp32 arithmetic of the
// bounds themselves. Each row works in units of t (the order of its outputs unchanged), where an
// output's upper bound is q.p s + s (|h|_1 / 2 + slack) / t + s Q1 / 2 (+ bias / t).
// A column can hold a row's pick only if bf16(its sum) >= bf16(the sum of the column with the
// largest lower bound L): bf16 rounds to within 2^-8 of a value, so only if its upper bound U has
// U + |U| 2^-8 >= L - |L| 2^-8, which holds only if U >= L' - 2^-7 |L'| with L' = L - |L| 2^-8
// (widened). Those columns' sums are computed again exactly as amx_linear computes them (the same
// tile products in the same order, so the same bits), from a row-major copy of the bf16 weight
// gathered 16 columns at a time into one packed block, and the picks are taken over them.
// On llama58m's head with the final norm's outputs, about 40 of 32000 columns a row remain.
constexpr float kBf16Ulp = 1.0f / 256;     // bf16's rounding, relative
constexpr float kTiny = 1e-30f;            // below every margin that counts: flushed denormals
constexpr int64_t kRowCandidates = 256;    // a row's list per thread range (compacted when full)
constexpr double kSumSlack = 4.0 * 127.0 / 16777216.0;  // times K: amx_linear's sum order, 4-fold
constexpr float kLargest = 1e35f;          // |x|_1 max|w| beyond this: unscreened (no overflow)

// the rows of x rounded to int8 and each row's terms of the bound, in units of its scale t
struct ScreenRows {
  std::vector<int8_t> q;             // [M][K]
  std::vector<float> inv_scale;      // 1 / t
  std::vector<float> l1_term;        // |h|_1 (1/2 + kSumSlack K) / t
  std::vector<uint8_t> unscreened;   // zero, not finite, or too large for the bound
};

ScreenRows round_rows(const at::BFloat16* x, int64_t x_stride, int64_t M, int64_t K, float max_scale) {
  ScreenRows r;
  r.q.resize(M * K);
  r.inv_scale.assign(M, 0.0f), r.l1_term.assign(M, 0.0f), r.unscreened.assign(M, 0);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  using engine_cpu::load_bf16;
  for (int64_t m = 0; m < M; ++m) {
    const at::BFloat16* h = x + m * x_stride;
    __m512 largest = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 a = _mm512_andnot_ps(sign, load_bf16(h + k));
      largest = _mm512_max_ps(largest, a);
      l1 = _mm512_add_ps(l1, a);
    }
    const float amax = _mm512_reduce_max_ps(largest), sum = _mm512_reduce_add_ps(l1);  // sum: NaN / inf stay
    const float inverse = 127.0f / amax;
    if (!(amax > 0) || !std::isfinite(sum) || !std::isfinite(inverse) || !(sum * max_scale * 128.0f < kLargest)) {
      r.unscreened[m] = 1;
      continue;
    }
    r.inv_scale[m] = inverse;
    r.l1_term[m] = static_cast<float>(sum * (0.5 + kSumSlack * K)) * inverse;
    const __m512 inv = _mm512_set1_ps(inverse);
    for (int64_t k = 0; k < K; k += 16)  // nearest (even), saturated to +-127 by the scale
      _mm_storeu_si128((__m128i*)(r.q.data() + m * K + k),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(h + k), inv))));
  }
  return r;
}

// one thread range's candidates: per row a threshold (the largest widened lower bound seen; +inf
// for rows left unscreened) and a list of (column, upper bound) that reached it when seen
struct ScreenRange {
  std::vector<float> threshold;
  std::vector<int32_t> count;
  std::unique_ptr<int32_t[]> cols;  // [M][kRowCandidates]
  std::unique_ptr<float[]> highs;
  std::vector<uint8_t> overflow;
};

// a lower bound L widened to the threshold L' - 2^-7 |L'| (L' = L - |L| 2^-8), less `tiny`
inline float widened(float low, float tiny) {
  const float l = low - std::fabs(low) * kBf16Ulp;
  return l - std::fabs(l) * 2 * kBf16Ulp - tiny;
}

// a block's int32 sums [rows][16] (rows m0...): each output's bounds, folded into range r. Most
// blocks end at the comparison: a block none of whose upper bounds reaches the threshold cannot
// raise it either (its lower bounds are lower still).
template <bool kBias>
void screen_block(const int32_t* sums, int rows, int64_t m0, int64_t n0, int64_t N, const float* w_scale,
                  const float* w_q1, const at::BFloat16* bias, const ScreenRows& x, ScreenRange& r) {
  const __mmask16 mask = columns_mask(n0, N);
  if (mask == 0) return;
  const __m512 s = _mm512_loadu_ps(w_scale + n0);
  const __m512 s_q1 = _mm512_mul_ps(_mm512_mul_ps(s, _mm512_loadu_ps(w_q1 + n0)), _mm512_set1_ps(0.5f + 1.0f / 2048));
  const __m512 bias_v = kBias ? bias_of(bias, n0, mask) : _mm512_setzero_ps();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(n0)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int i = 0; i < rows; ++i) {
    const int64_t m = m0 + i;
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + i * kCols));
    const __m512 bound = _mm512_fmadd_ps(s, _mm512_set1_ps(x.l1_term[m]), s_q1);
    __m512 center = _mm512_mul_ps(sum, s);
    if (kBias) center = _mm512_fmadd_ps(bias_v, _mm512_set1_ps(x.inv_scale[m]), center);
    const __m512 high = _mm512_add_ps(center, bound);
    __mmask16 reach = _mm512_mask_cmp_ps_mask(mask, high, _mm512_set1_ps(r.threshold[m]), _CMP_GE_OQ);
    if (reach == 0) continue;
    const __m512 low = _mm512_mask_blend_ps(mask, neg_inf, _mm512_sub_ps(center, bound));
    const float raised = widened(_mm512_reduce_max_ps(low), kTiny * x.inv_scale[m]);
    if (raised > r.threshold[m]) {
      r.threshold[m] = raised;
      reach = _mm512_mask_cmp_ps_mask(mask, high, _mm512_set1_ps(raised), _CMP_GE_OQ);
    }
    if (reach == 0 || r.overflow[m]) continue;
    int32_t& count = r.count[m];
    int32_t* row_cols = r.cols.get() + m * kRowCandidates;
    float* row_highs = r.highs.get() + m * kRowCandidates;
    if (count + 16 > kRowCandidates) {  // full: keep those that still reach the threshold
      int32_t kept = 0;
      for (int32_t c = 0; c < count; ++c)
        if (row_highs[c] >= r.threshold[m]) row_cols[kept] = row_cols[c], row_highs[kept++] = row_highs[c];
      count = kept;
      if (count + 16 > kRowCandidates) {
        r.overflow[m] = 1;
        continue;
      }
    }
    _mm512_mask_compressstoreu_epi32(row_cols + count, reach, cols);
    _mm512_mask_compressstoreu_ps(row_highs + count, reach, high);
    count += __builtin_popcount(reach);
  }
}

// blocks [b0, b1) of the int8 weight for every row of x, into r
void screen_blocks(const ScreenRows& x, int64_t M, int64_t K, const int8_t* qweight, const float* w_scale,
                   const float* w_q1, const at::BFloat16* bias, int64_t N, int64_t b0, int64_t b1, ScreenRange& r) {
  const int64_t steps = K / 64, block_elems = K * kCols;
  alignas(64) float sums[4][16 * kCols];
  int configured0 = -1, configured1 = -1;
  for (int64_t g = b0; g < b1; g += 2) {
    const bool two_blocks = g + 1 < b1;
    const int8_t* w0 = qweight + g * block_elems;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m0));
      const int rows1 = static_cast<int>(std::clamp<int64_t>(M - m0 - 16, 0, 16));
      configure_once(rows0, rows1, configured0, configured1);
      dispatch_pass(rows1 > 0, two_blocks, m0 == 0, x.q.data() + m0 * K, K, w0, w0 + block_elems, steps, block_elems,
                    sums);
      auto fold = [&](int tile, int rows, int64_t m, int64_t block) {
        const int32_t* tile_sums = reinterpret_cast<const int32_t*>(sums[tile]);
        bias != nullptr ? screen_block<true>(tile_sums, rows, m, block * kCols, N, w_scale, w_q1, bias, x, r)
                        : screen_block<false>(tile_sums, rows, m, block * kCols, N, w_scale, w_q1, bias, x, r);
      };
      fold(0, rows0, m0, g);
      if (two_blocks) fold(1, rows0, m0, g + 1);
      if (rows1 > 0) {
        fold(2, rows1, m0 + 16, g);
        if (two_blocks) fold(3, rows1, m0 + 16, g + 1);
      }
    }
  }
}

// columns cols[0, n) (n <= 16) of a row-major [N, K] bf16 weight as one packed block [K/2][16][2]
// (the lanes past n zero)
void gather_block(const at::BFloat16* rowmajor, int64_t K, const int32_t* cols, int n, uint32_t* block) {
  for (int lane = 0; lane < kCols; ++lane) {
    const uint32_t* src = lane < n ? reinterpret_cast<const uint32_t*>(rowmajor + cols[lane] * K) : nullptr;
    for (int64_t p = 0; p < K / 2; ++p) block[p * kCols + lane] = src != nullptr ? src[p] : 0;
  }
}

// a group of up to 16 columns (increasing) whose sums the 16-row slices of x in `slices` (bits, of
// the 64 rows from m0) need exactly
struct ExactGroup {
  int64_t m0;
  uint32_t slices;
  int n;
  int32_t cols[kCols];
};

// the columns that reach their rows' final thresholds, by 64 rows of x: the columns that the same
// slices need are grouped together, so a group is computed only for the slices that need it
std::vector<ExactGroup> exact_groups(const std::vector<ScreenRange>& ranges, const std::vector<float>& threshold,
                                     const std::vector<uint8_t>& unscreened, int64_t M, int64_t N) {
  std::vector<ExactGroup> groups;
  const int64_t words = (N + 63) / 64;
  std::vector<uint64_t> marked(4 * words);  // a bit per column for each slice of the 64 rows
  std::vector<int32_t> by_slices[16];
  for (int64_t c0 = 0; c0 < M; c0 += 64) {
    std::fill(marked.begin(), marked.end(), 0);
    for (const ScreenRange& r : ranges)
      for (int64_t m = c0; m < std::min(M, c0 + 64); ++m) {
        if (unscreened[m]) continue;
        uint64_t* slice_bits = marked.data() + (m - c0) / 16 * words;
        const int32_t* cols = r.cols.get() + m * kRowCandidates;
        const float* highs = r.highs.get() + m * kRowCandidates;
        for (int32_t c = 0; c < r.count[m]; ++c)
          if (highs[c] >= threshold[m]) slice_bits[cols[c] / 64] |= uint64_t{1} << (cols[c] % 64);
      }
    for (std::vector<int32_t>& cols : by_slices) cols.clear();
    for (int64_t word = 0; word < words; ++word) {
      const uint64_t b0 = marked[word], b1 = marked[words + word], b2 = marked[2 * words + word];
      const uint64_t b3 = marked[3 * words + word];
      for (uint64_t any = b0 | b1 | b2 | b3; any != 0; any &= any - 1) {
        const int bit = __builtin_ctzll(any);
        const unsigned slices = ((b0 >> bit) & 1) | ((b1 >> bit) & 1) << 1 | ((b2 >> bit) & 1) << 2 | ((b3 >> bit) & 1) << 3;
        by_slices[slices].push_back(static_cast<int32_t>(word * 64 + bit));
      }
    }
    for (uint32_t slices = 1; slices < 16; ++slices)
      for (size_t i = 0; i < by_slices[slices].size(); i += kCols) {
        ExactGroup group{c0, slices, static_cast<int>(std::min<size_t>(kCols, by_slices[slices].size() - i)), {}};
        std::copy_n(by_slices[slices].data() + i, group.n, group.cols);
        groups.push_back(group);
      }
  }
  return groups;
}

// a group's rows of the row-major weight, into L2
inline void prefetch_rows(const at::BFloat16* rowmajor, int64_t K, const ExactGroup& group) {
  for (int lane = 0; lane < group.n; ++lane) {
    const char* row = reinterpret_cast<const char*>(rowmajor + group.cols[lane] * K);
    for (int64_t line = 0; line < K * 2; line += 64) _mm_prefetch(row + line, _MM_HINT_T1);
  }
}

// Greedy picks of x's rows screened as above; returns (columns computed exactly, rows that ran
// unscreened through run_amx instead).
std::pair<int64_t, int64_t> run_screened(int64_t* picks, const at::BFloat16* xp, int64_t xs, int64_t M, int64_t K,
                                         const at::BFloat16* wp, int64_t blocks, const at::BFloat16* bp, int64_t N,
                                         const int8_t* qweight, const float* w_scale, const float* w_q1,
                                         float max_scale, const at::BFloat16* rowmajor) {
  const ScreenRows x = round_rows(xp, xs, M, K, max_scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::mutex lock;
  std::vector<ScreenRange> ranges;
  at::parallel_for(0, (blocks + 1) / 2, 8, [&](int64_t u0, int64_t u1) {
    ScreenRange r;
    r.threshold.resize(M);
    for (int64_t m = 0; m < M; ++m) r.threshold[m] = x.unscreened[m] ? -neg_inf : neg_inf;
    r.count.assign(M, 0), r.overflow.assign(M, 0);
    r.cols.reset(new int32_t[M * kRowCandidates]), r.highs.reset(new float[M * kRowCandidates]);
    screen_blocks(x, M, K, qweight, w_scale, w_q1, bp, N, 2 * u0, std::min(blocks, 2 * u1), r);
    std::lock_guard<std::mutex> guard(lock);
    ranges.push_back(std::move(r));
  });
  // each row's threshold over all ranges, and the union of the columns that reach it
  std::vector<uint8_t> unscreened = x.unscreened;
  std::vector<float> threshold(M, neg_inf);
  for (const ScreenRange& r : ranges)
    for (int64_t m = 0; m < M; ++m) {
      threshold[m] = std::max(threshold[m], r.threshold[m]);
      unscreened[m] |= r.overflow[m];
    }
  for (int64_t m = 0; m < M; ++m)
    if (!std::isfinite(threshold[m])) unscreened[m] = 1;
  const std::vector<ExactGroup> groups = exact_groups(ranges, threshold, unscreened, M, N);
  int64_t columns = 0;
  for (const ExactGroup& group : groups) columns += group.n;
  // those columns' sums as amx_linear computes them, a group at a time
  const int64_t pairs = K / 2, steps = pairs / kStepPairs, block_elems = pairs * 2 * kCols;
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  RangePicks found;
  at::parallel_for(0, n_groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<RowBest> best(M, RowBest{neg_inf, std::numeric_limits<int64_t>::max(), -1});
    std::vector<uint32_t> block(pairs * kCols);
    const at::BFloat16* w = reinterpret_cast<const at::BFloat16*>(block.data());
    alignas(64) float sums[4][16 * kCols];
    int configured0 = -1, configured1 = -1;
    prefetch_rows(rowmajor, K, groups[g0]);
    for (int64_t g = g0; g < g1; ++g) {
      const ExactGroup& group = groups[g];
      if (g + 1 < g1) prefetch_rows(rowmajor, K, groups[g + 1]);
      gather_block(rowmajor, K, group.cols, group.n, block.data());
      const __mmask16 mask = static_cast<__mmask16>((1u << group.n) - 1);
      alignas(64) float bias_g[kCols] = {};
      if (bp != nullptr)
        for (int lane = 0; lane < group.n; ++lane) bias_g[lane] = static_cast<float>(bp[group.cols[lane]]);
      const __m512 bias_v = _mm512_load_ps(bias_g);
      for (uint32_t slices = group.slices; slices != 0; slices &= slices - 1) {
        const int64_t m0 = group.m0 + 16 * __builtin_ctz(slices);
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
        configure_once(rows, 0, configured0, configured1);
        const at::BFloat16* x0 = xp + m0 * xs;
        dispatch_pass(false, false, false, x0, xs, w, w, steps, block_elems, sums);
        fold_picks(sums[0], rows, x0, xs, w, steps * kStepPairs, pairs, bias_v, mask, 0, group.cols,
                   best.data() + m0);
      }
    }
    std::lock_guard<std::mutex> guard(lock);
    found.push_back(std::move(best));
  });
  if (!found.empty()) merge_picks(found, M, picks);
  // the rows left out, as amx_linear_argmax picks them
  std::vector<int64_t> rows;
  for (int64_t m = 0; m < M; ++m)
    if (unscreened[m]) rows.push_back(m);
  if (!rows.empty()) {
    const int64_t R = static_cast<int64_t>(rows.size());
    std::vector<at::BFloat16> gathered(R * K);
    for (int64_t i = 0; i < R; ++i) std::memcpy(gathered.data() + i * K, xp + rows[i] * xs, K * sizeof(at::BFloat16));
    std::vector<int64_t> row_picks(R);
    run_amx(nullptr, 0, gathered.data(), K, R, K, wp, blocks, bp, N, 0, row_picks.data());
    for (int64_t i = 0; i < R; ++i) picks[rows[i]] = row_picks[i];
  }
  return {columns, static_cast<int64_t>(rows.size())};
}
#endif

}  // namespace

// out [M, N] = x [M, K] @ W^T + bias on AMX tiles, W packed by pack_gemv_weight ([ceil(N/16), K/2,
// 16, 2] bf16). Any M >= 1, K % 8 == 0; bias is [N] bf16 or empty. The sums are fp32; each row's
// order of summation depends on K only (32 k at a time, then the tail), not on M.
void amx_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(amx_supported(), "amx_linear: this CPU, build or OS does not allow AMX tiles");
  engine_cpu::check_packed_linear("amx_linear", out, x, packed, bias);
#if defined(ENGINE_CPU_AMX)
  run_amx(out.data_ptr<at::BFloat16>(), out.stride(0), x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), x.size(1),
          packed.data_ptr<at::BFloat16>(), packed.size(0), bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr,
          out.size(1), 0);
#endif
}

// A gated MLP's first half: out [M, I] = silu(x @ Wg^T + bg) * (x @ Wu^T + bu) for W = [Wg; Wu]
// ([2I, K], packed by pack_gemv_weight; I % 16 == 0) and bias [2I] or empty, each product rounded
// to bf16 first, exactly as amx_linear followed by silu_and_mul, without the [M, 2I] in between.
void amx_gated_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(amx_supported(), "amx_gated_linear: this CPU, build or OS does not allow AMX tiles");
  const int64_t half = out.size(1);
  TORCH_CHECK(out.dim() == 2 && half % 16 == 0 && packed.dim() == 4 && packed.size(0) * 16 == 2 * half,
              "amx_gated_linear: out [M, I] with I % 16 == 0 for a packed [2I, K] weight");
  engine_cpu::check_packed_input("amx_gated_linear", x, packed, bias, 2 * half);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "amx_gated_linear: out [M, I] bf16 rows");
#if defined(ENGINE_CPU_AMX)
  run_amx(out.data_ptr<at::BFloat16>(), out.stride(0), x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), x.size(1),
          packed.data_ptr<at::BFloat16>(), packed.size(0), bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr,
          2 * half, half);
#endif
}

// Greedy picks of rows of x through a weight packed by pack_gemv_weight ([ceil(N/16), K/2, 16, 2]
// bf16, N outputs; bias [N] bf16 or empty): out[m] is argmax(amx_linear(x, W, bias)[m]) as the
// argmax kernel gives it (the first of equal outputs as rounded to bf16, a NaN counting as the
// largest), without the [M, N] outputs ever being stored.
void amx_linear_argmax(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(amx_supported(), "amx_linear_argmax: this CPU, build or OS does not allow AMX tiles");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() && out.numel() == x.size(0),
              "amx_linear_argmax: out is [M] int64");
  TORCH_CHECK(N >= 1, "amx_linear_argmax: no outputs");
  engine_cpu::check_packed_input("amx_linear_argmax", x, packed, bias, N);
#if defined(ENGINE_CPU_AMX)
  run_amx(nullptr, 0, x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), x.size(1), packed.data_ptr<at::BFloat16>(),
          packed.size(0), bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr, N, 0, out.data_ptr<int64_t>());
#endif
}

// Greedy picks exactly as amx_linear_argmax gives them (out [M] int64), most columns ruled out on
// an int8 copy of the weight first (run_screened): qweight [ceil(N/16), K/4, 16, 4] int8 with
// round(w / scale) of each output column, scale [ceil(N/16) * 16] fp32 (max |w| / 127, zero past N),
// q1 [ceil(N/16) * 16] fp32 (the sum of |qweight| of each column), max_scale the largest scale, and
// rowmajor [N, K] the bf16 weight itself; K % 64 == 0. Returns (columns whose sums were computed
// exactly, rows that ran unscreened).
std::tuple<int64_t, int64_t> amx_linear_argmax_screened(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                                        torch::Tensor bias, int64_t N, torch::Tensor qweight,
                                                        torch::Tensor scale, torch::Tensor q1, double max_scale,
                                                        torch::Tensor rowmajor) {
  constexpr const char* name = "amx_linear_argmax_screened";
  TORCH_CHECK(amx_supported(), name, ": this CPU, build or OS does not allow AMX tiles");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() && out.numel() == x.size(0),
              name, ": out is [M] int64");
  TORCH_CHECK(N >= 1, name, ": no outputs");
  engine_cpu::check_packed_input(name, x, packed, bias, N);
  const int64_t K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(K % 64 == 0, name, ": K must be a multiple of 64");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous() && qweight.dim() == 4 &&
                  qweight.size(0) == blocks && qweight.size(1) * 4 == K && qweight.size(2) == 16 && qweight.size(3) == 4,
              name, ": qweight must be [ceil(N/16), K/4, 16, 4] int8");
  for (const torch::Tensor* t : {&scale, &q1})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == blocks * 16, name,
                ": scale and q1 must be [ceil(N/16) * 16] fp32");
  TORCH_CHECK(rowmajor.scalar_type() == at::kBFloat16 && rowmajor.is_contiguous() && rowmajor.dim() == 2 &&
                  rowmajor.size(0) == N && rowmajor.size(1) == K,
              name, ": rowmajor must be the [N, K] bf16 weight");
#if defined(ENGINE_CPU_AMX)
  const auto [columns, rows] =
      run_screened(out.data_ptr<int64_t>(), x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), K,
                   packed.data_ptr<at::BFloat16>(), blocks, bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr, N,
                   qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), q1.data_ptr<float>(),
                   static_cast<float>(max_scale), rowmajor.data_ptr<at::BFloat16>());
  return {columns, rows};
#else
  return {0, 0};
#endif
}
