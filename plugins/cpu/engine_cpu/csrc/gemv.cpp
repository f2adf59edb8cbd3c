// bf16 products of rows of activations with a weight, AVX512-BF16: decode and prefill.
//
// Decode reads every weight once per step, so with few rows its speed is the speed
// at which the weights stream from memory, and with a few dozen the speed of the
// dot-product unit. The weight is packed once into [N/16][K/2][16][2]: each 64-byte
// line holds two consecutive k of 16 output columns, which is exactly one vdpbf16ps
// operand, and a thread's share of the columns is one contiguous stream. Below 4 rows,
// rows go over one block of columns at a time with several accumulators each; from 4 rows,
// in passes of 6 rows over 4 blocks (24 accumulators: each weight vector loaded once for 6
// rows, each activation pair broadcast once for 4 blocks), whose weights stay in L1/L2
// between passes, and x in sweeps of 192 rows that stay in L2.
#include "kernel.h"
#include "packed_weight.h"

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

bool gemv_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kCols = 16;      // output columns per block (one zmm of fp32)
constexpr int64_t kTileRows = 16;  // rows per pass over a block (one accumulator each)

constexpr int64_t kInvariantTileRows = 4;  // batch-invariant passes: 4 rows x 4 accumulators

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead a weight stream is prefetched

// sums[m] = x[m] . W[block columns] for M rows over K / 2 pairs of one packed block; with few
// rows, U accumulators per row hide the dpbf16 latency. Pair p goes to accumulator p % U, and
// the U are summed in order at the end, so a row's result depends on U but not on M.
template <int M, int U>
inline void block_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs, __m512* sums) {
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 4) {
    const at::BFloat16* wp = w + p * 2 * kCols;
    // 2 KB ahead: with 1 KB, a model's chain of 1-row products streamed 47-67 GB/s, with 2 KB
    // 49-72 GB/s (AMD EPYC, Zen 5, 2 threads; each round paired)
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes + 192, _MM_HINT_T0);
    for (int u = 0; u < 4; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + u * 2 * kCols);
      for (int m = 0; m < M; ++m) {
        int32_t xpair;
        std::memcpy(&xpair, x + m * x_stride + (p + u) * 2, sizeof(xpair));
        acc[m][u % U] = _mm512_dpbf16_ps(acc[m][u % U], wv, (__m512bh)_mm512_set1_epi32(xpair));
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    __m512 sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[m][u]);
    sums[m] = sum;
  }
}

// the tuned choice: 4 accumulators per row below 4 rows, 1 from 4 rows (up to 16 per pass)
template <int... Ms>
inline void block_rows_n(int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs,
                         __m512* sums, std::integer_sequence<int, Ms...>) {
  ((rows == Ms + 1 ? block_rows<Ms + 1, (Ms + 1 >= 4 ? 1 : 4)>(x, x_stride, w, pairs, sums) : void()), ...);
}

// batch-invariant: 4 accumulators per row whatever the row count (up to 4 rows per pass)
template <int... Ms>
inline void block_rows_fixed(int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs,
                             __m512* sums, std::integer_sequence<int, Ms...>) {
  ((rows == Ms + 1 ? block_rows<Ms + 1, 4>(x, x_stride, w, pairs, sums) : void()), ...);
}

// sums[r][nb] = x[r] . W[columns of block nb] for R rows and NB consecutive packed blocks over
// K / 2 pairs: each pair's NB weight vectors are loaded once for R rows and each row's pair
// broadcast once for NB blocks (NB + R loads per R * NB dpbf16, against 1 + 16 per 16 for one
// block at a time). One accumulator per (row, block), pairs in order: a row's sums are those
// of block_rows<M, 1>. With `stream`, the blocks are being read from memory for the first time
// and are prefetched ahead.
template <int R, int NB>
inline void tile_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs, bool stream,
                      __m512 (*sums)[4]) {
  const int64_t block_stride = pairs * 2 * kCols;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* wp = w + p * 2 * kCols;
    if (stream)
      for (int nb = 0; nb < NB; ++nb) _mm_prefetch(reinterpret_cast<const char*>(wp + nb * block_stride) + kPrefetchBytes, _MM_HINT_T0);
    __m512bh wv[NB];
    for (int nb = 0; nb < NB; ++nb) wv[nb] = (__m512bh)_mm512_loadu_si512(wp + nb * block_stride);
    for (int r = 0; r < R; ++r) {
      int32_t xpair;
      std::memcpy(&xpair, x + r * x_stride + p * 2, sizeof(xpair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpair);
      for (int nb = 0; nb < NB; ++nb) acc[r][nb] = _mm512_dpbf16_ps(acc[r][nb], wv[nb], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int nb = 0; nb < NB; ++nb) sums[r][nb] = acc[r][nb];
}

constexpr int64_t kGroupBlocks = 4;  // blocks per tile_rows group (64 output columns)
constexpr int64_t kGroupRows = 6;    // rows per tile_rows pass: 6 x 4 accumulators + 4 weights + 1 broadcast

template <int NB>
inline void tile_rows_n(int rows, const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs,
                        bool stream, __m512 (*sums)[4]) {
  switch (rows) {
    case 4: tile_rows<4, NB>(x, x_stride, w, pairs, stream, sums); break;
    case 5: tile_rows<5, NB>(x, x_stride, w, pairs, stream, sums); break;
    default: tile_rows<6, NB>(x, x_stride, w, pairs, stream, sums); break;
  }
}

using engine_cpu::bias_of;
using engine_cpu::columns_mask;

// blocks [b0, b1) of the output columns, for all M rows, in passes of up to kTileRows rows (the
// block's weights stay in L1/L2 between passes)
void gemv_blocks(const at::BFloat16* x, int64_t x_stride, int64_t M, const at::BFloat16* packed,
                 const at::BFloat16* bias, at::BFloat16* out, int64_t out_stride, int64_t N, int64_t K, int64_t b0,
                 int64_t b1, bool invariant) {
  const int64_t pairs = K / 2;
  __m512 sums[kTileRows];
  for (int64_t b = b0; b < b1; ++b) {
    const at::BFloat16* w = packed + b * pairs * 2 * kCols;
    const int64_t n0 = b * kCols;
    const __mmask16 mask = columns_mask(n0, N);
    const __m512 bias_v = bias_of(bias, n0, mask);
    const int64_t tile = invariant ? kInvariantTileRows : kTileRows;
    for (int64_t r0 = 0; r0 < M; r0 += tile) {
      const int rows = static_cast<int>(std::min(tile, M - r0));
      if (invariant)
        block_rows_fixed(rows, x + r0 * x_stride, x_stride, w, pairs, sums,
                         std::make_integer_sequence<int, kInvariantTileRows>{});
      else
        block_rows_n(rows, x + r0 * x_stride, x_stride, w, pairs, sums, std::make_integer_sequence<int, kTileRows>{});
      for (int m = 0; m < rows; ++m) {
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums[m], bias_v));  // nearest even
        _mm256_mask_storeu_epi16(out + (r0 + m) * out_stride + n0, mask, rounded);
      }
    }
  }
}

constexpr int64_t kChunkRows = 192;  // rows of x per sweep over the blocks: they stay in L2 meanwhile

// The same for M >= 4 rows (not batch-invariant) with tile_rows: groups of kGroupBlocks blocks,
// rows in passes of kGroupRows (a last pass of fewer than 4 rows goes block by block).
void gemm_blocks(const at::BFloat16* x, int64_t x_stride, int64_t M, const at::BFloat16* packed,
                 const at::BFloat16* bias, at::BFloat16* out, int64_t out_stride, int64_t N, int64_t K, int64_t b0,
                 int64_t b1) {
  if (M > kChunkRows) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, M - m0);
      if (rows >= 4)
        gemm_blocks(x + m0 * x_stride, x_stride, rows, packed, bias, out + m0 * out_stride, out_stride, N, K, b0, b1);
      else
        gemv_blocks(x + m0 * x_stride, x_stride, rows, packed, bias, out + m0 * out_stride, out_stride, N, K, b0, b1,
                    false);
    }
    return;
  }
  const int64_t pairs = K / 2;
  __m512 sums[kGroupRows][4];
  for (int64_t g = b0; g < b1; g += kGroupBlocks) {
    const int nb = static_cast<int>(std::min(kGroupBlocks, b1 - g));
    const at::BFloat16* w = packed + g * pairs * 2 * kCols;
    __mmask16 masks[kGroupBlocks];
    __m512 biases[kGroupBlocks];
    for (int j = 0; j < nb; ++j) {
      masks[j] = columns_mask((g + j) * kCols, N);
      biases[j] = bias_of(bias, (g + j) * kCols, masks[j]);
    }
    int64_t r0 = 0;
    for (; M - r0 >= 4; r0 += kGroupRows) {
      const int rows = static_cast<int>(std::min(kGroupRows, M - r0));
      const at::BFloat16* xr = x + r0 * x_stride;
      switch (nb) {
        case 1: tile_rows_n<1>(rows, xr, x_stride, w, pairs, r0 == 0, sums); break;
        case 2: tile_rows_n<2>(rows, xr, x_stride, w, pairs, r0 == 0, sums); break;
        case 3: tile_rows_n<3>(rows, xr, x_stride, w, pairs, r0 == 0, sums); break;
        default: tile_rows_n<4>(rows, xr, x_stride, w, pairs, r0 == 0, sums); break;
      }
      for (int m = 0; m < rows; ++m)
        for (int j = 0; j < nb; ++j) {
          const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums[m][j], biases[j]));
          _mm256_mask_storeu_epi16(out + (r0 + m) * out_stride + (g + j) * kCols, masks[j], rounded);
        }
      if (rows < kGroupRows) r0 += rows - kGroupRows;  // the last pass took fewer rows
    }
    if (r0 < M)
      gemv_blocks(x + r0 * x_stride, x_stride, M - r0, packed, bias, out + r0 * out_stride, out_stride, N, K, g,
                  g + nb, false);
  }
}

}  // namespace
#endif

// out [M, N] = x [M, K] @ W^T + bias, with W packed by pack_gemv_weight ([ceil(N/16), K/2, 16, 2] bf16).
// Any M >= 1, K % 8 == 0; bias is
// [N] bf16 or empty. With batch_invariant, every row's sums run in one fixed order (4 partial
// sums per row, whatever M is), so a row's result is bitwise the same in any batch.
void gemv(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias, bool batch_invariant) {
  TORCH_CHECK(gemv_supported(), "gemv: this CPU or build has no AVX512-BF16");
  engine_cpu::check_packed_linear("gemv", out, x, packed, bias);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = packed.size(0), xs = x.stride(0), os = out.stride(0);
  // contiguous block ranges per thread: one weight stream each
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    if (M >= 4 && !batch_invariant)
      gemm_blocks(xp, xs, M, wp, bp, op, os, N, K, b0, b1);
    else
      gemv_blocks(xp, xs, M, wp, bp, op, os, N, K, b0, b1, batch_invariant);
  });
#endif
}
