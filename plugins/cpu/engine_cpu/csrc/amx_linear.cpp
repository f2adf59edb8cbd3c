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
#include "kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
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
// and its first column, and the first column holding a NaN (-1: none), as argmax counts them
struct RowBest {
  float value;
  int64_t index, nan_index;
};

// a block's sums finished as finish_block finishes them (tail, bias, bf16 rounding), folded into
// each row's RowBest instead of stored; columns arrive in increasing order, so a strictly
// greater value replaces and equal ones keep the first
void finish_argmax(const float* sums, int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w,
                   int64_t tail_from, int64_t pairs, const at::BFloat16* bias, int64_t n0, int64_t N, RowBest* best) {
  const __mmask16 mask = columns_mask(n0, N);
  if (mask == 0) return;
  const __m512 bias_v = bias_of(bias, n0, mask);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < rows; ++m) {
    const __m512 v = bf16_rounded(finished_sums(sums + m * kCols, bias_v, x + m * x_stride, w, tail_from, pairs));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & mask;
    if (nan && best[m].nan_index < 0) best[m].nan_index = n0 + __builtin_ctz(nan);
    const __m512 valid = _mm512_mask_blend_ps(mask & ~nan, neg_inf, v);
    const float block_max = _mm512_reduce_max_ps(valid);
    if (block_max > best[m].value) {
      best[m].value = block_max;
      best[m].index = n0 + __builtin_ctz(_mm512_cmp_ps_mask(valid, _mm512_set1_ps(block_max), _CMP_EQ_OQ) & mask);
    }
  }
}

// the 16 lines of B tile `elem` elements into block w's stream, past its end (block_elems) the
// same place in the next pair's block, into L2
inline void prefetch_tile(const at::BFloat16* w, int64_t elem, int64_t block_elems) {
  const char* p = reinterpret_cast<const char*>(elem < block_elems ? w + elem : w + block_elems + elem);
  for (int line = 0; line < 16; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
}

// one pass: rows [m0, m0 + rows0 + rows1) of x (rows0 <= 16 in slice 0, rows1 <= 16 in slice 1)
// over blocks g and g + 1 (one of them without kTwoBlocks), the C tiles summed over the whole
// multiple of 32 of K; the first pass over the blocks (kFirst) prefetches their next B tiles
template <bool kTwoSlices, bool kTwoBlocks, bool kFirst>
inline void tile_pass(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w0, const at::BFloat16* w1,
                      int64_t steps, int64_t block_elems, float (*sums)[16 * kCols]) {
  const int64_t x_bytes = x_stride * sizeof(at::BFloat16);
  const int64_t w_bytes = 2 * kCols * sizeof(at::BFloat16);
  _tile_zero(0);
  if (kTwoBlocks) _tile_zero(1);
  if (kTwoSlices) {
    _tile_zero(2);
    if (kTwoBlocks) _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k0 = s * 2 * kStepPairs;
    if (kFirst) {
      prefetch_tile(w0, (k0 + 2 * kStepPairs) * kCols, block_elems);
      if (kTwoBlocks) prefetch_tile(w1, (k0 + 2 * kStepPairs) * kCols, block_elems);
    }
    _tile_loadd(4, x + k0, x_bytes);
    _tile_loadd(6, w0 + k0 * kCols, w_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if (kTwoSlices) {
      _tile_loadd(5, x + 16 * x_stride + k0, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (kTwoBlocks) {
      _tile_loadd(7, w1 + k0 * kCols, w_bytes);
      _tile_dpbf16ps(1, 4, 7);
      if (kTwoSlices) _tile_dpbf16ps(3, 5, 7);
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
      if (rows0 != configured0 || rows1 != configured1) {
        configure(rows0, rows1);
        configured0 = rows0;
        configured1 = rows1;
      }
      const at::BFloat16* xs = x + m0 * x_stride;
      if (steps > 0) {
        auto pass = [&](auto two_slices, auto first) {
          constexpr bool kSlices = decltype(two_slices)::value, kFirst = decltype(first)::value;
          two_blocks ? tile_pass<kSlices, true, kFirst>(xs, x_stride, w0, w1, steps, block_elems, sums)
                     : tile_pass<kSlices, false, kFirst>(xs, x_stride, w0, w1, steps, block_elems, sums);
        };
        using Yes = std::true_type;
        using No = std::false_type;
        const bool first = cold && m0 == 0;
        if (rows1 > 0)
          first ? pass(Yes{}, Yes{}) : pass(Yes{}, No{});
        else
          first ? pass(No{}, Yes{}) : pass(No{}, No{});
      } else {
        std::memset(sums, 0, sizeof(sums));
      }
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
// out = x @ W^T + bias (half == 0), or silu(gate) * up of a gated MLP's weight (half > 0): the
// threads take contiguous ranges of block pairs (one weight stream each)
// With picks (M entries): out is not written; each row's greedy pick over all N columns goes there.
void run_amx(at::BFloat16* op, int64_t os, const at::BFloat16* xp, int64_t xs, int64_t M, int64_t K,
             const at::BFloat16* wp, int64_t blocks, const at::BFloat16* bp, int64_t N, int64_t half,
             int64_t* picks = nullptr) {
  const int64_t units = half > 0 ? half / kCols : (blocks + 1) / 2;  // gate blocks, or block pairs
  const int64_t per_unit = half > 0 ? 1 : 2;                          // blocks a unit starts apart
  std::mutex found_lock;
  std::vector<std::pair<int64_t, std::vector<RowBest>>> found;  // (first column, its range's picks)
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
      found.emplace_back(b0 * kCols, std::move(best_store));
    }
  });
  if (picks == nullptr) return;
  // ranges in column order: a later range's pick replaces only with a strictly greater value
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (int64_t m = 0; m < M; ++m) {
    RowBest row{-std::numeric_limits<float>::infinity(), 0, -1};
    for (const auto& [first, range] : found) {
      if (row.nan_index < 0 && range[m].nan_index >= 0) row.nan_index = range[m].nan_index;
      if (range[m].value > row.value) row.value = range[m].value, row.index = range[m].index;
    }
    picks[m] = row.nan_index >= 0 ? row.nan_index : row.index;
  }
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
