// Causal attention for long prefill chunks over the paged KV cache (bf16, AVX512-BF16).
//
// A work item is (sequence, tile of up to 64 query rows, kv head). Its keys are read
// once from the cache into two work layouts: K as bf16 pairs transposed 16 keys at a
// time (one dpbf16 scores 16 keys against a pair of dims of one query), V widened to
// fp32. Query rows are then processed 4 at a time so that every key load feeds 4
// independent dot products and the 4 rows' outputs stay in registers; online softmax
// in fp32 per 16-key tile.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

bool prefill_kernel_supported(int64_t head_size) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return head_size == 32 || head_size == 64 || head_size == 128;
#else
  (void)head_size;
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kKeys = 64;  // keys per tile (four zmm of scores)
constexpr int64_t kVecs = kKeys / 16;
constexpr int64_t kRows = 4;   // query rows sharing each key load
constexpr int64_t kQueryTile = 64;

struct Scratch {
  std::vector<uint32_t> kt;  // [key tiles][D/2][16] bf16 pairs
  std::vector<float> vf;     // [keys][D] fp32
};

template <int D>
void prefill_item(at::BFloat16* out, const at::BFloat16* q, const at::BFloat16* key_cache,
                  const at::BFloat16* value_cache, const int64_t* table, int64_t q_start, int64_t rows,
                  int64_t first_pos, int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                  float scale, int64_t window, Scratch& scratch) {
  constexpr int64_t P = D / 2, C = D / 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * D;
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k0 = lo - lo % kKeys;  // tiles start at multiples of kKeys
  const int64_t num_keys = last_pos + 1 - k0;
  const int64_t tiles = (num_keys + kKeys - 1) / kKeys;
  scratch.kt.assign(tiles * P * kKeys, 0u);
  scratch.vf.assign(tiles * kKeys * D, 0.f);
  for (int64_t j = 0; j < num_keys; ++j) {
    const int64_t pos = k0 + j;
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const uint32_t* krow = reinterpret_cast<const uint32_t*>(key_cache + slot * row_stride + g * D);
    uint32_t* kt = scratch.kt.data() + (j / kKeys) * P * kKeys + j % kKeys;
    for (int64_t p = 0; p < P; ++p) kt[p * kKeys] = krow[p];
    const at::BFloat16* vrow = value_cache + slot * row_stride + g * D;
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(&scratch.vf[j * D + c * 16], engine_cpu::load_bf16(vrow + c * 16));
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < group; ++h) {
    const int64_t head = g * group + h;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t nr = std::min(kRows, rows - r0);
      const uint32_t* qrow[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        qrow[r] = reinterpret_cast<const uint32_t*>(q + ((q_start + r0 + std::min(r, nr - 1)) * num_heads + head) * D);
      }
      __m512 acc[kRows][C];
      float m[kRows], l[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
      }
      const int64_t row_last = first_pos + r0 + nr - 1;
      for (int64_t t = 0; t * kKeys + k0 <= row_last; ++t) {
        const int64_t tile_start = k0 + t * kKeys;
        const uint32_t* kt = scratch.kt.data() + t * P * kKeys;
        __m512 s[kRows][kVecs];
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t x = 0; x < kVecs; ++x) s[r][x] = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; ++p) {
          __m512bh k[kVecs];
          for (int64_t x = 0; x < kVecs; ++x) k[x] = (__m512bh)_mm512_loadu_si512(kt + p * kKeys + x * 16);
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[r][p]));
            for (int64_t x = 0; x < kVecs; ++x) s[r][x] = _mm512_dpbf16_ps(s[r][x], qp, k[x]);
          }
        }
        alignas(64) float e[kRows][kKeys];
        float corr[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t pos = first_pos + r0 + std::min(r, nr - 1);
          // keys tile_start + j are allowed for j in [key_lo, key_hi]
          const int64_t key_hi = std::min<int64_t>(kKeys - 1, pos - tile_start);
          const int64_t key_lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - tile_start) : 0;
          __mmask16 valid[kVecs];
          bool any = false;
          __m512 vmax = neg_inf;
          for (int64_t x = 0; x < kVecs; ++x) {
            const int64_t hi = std::min<int64_t>(15, key_hi - x * 16), lo_ = std::max<int64_t>(0, key_lo - x * 16);
            valid[x] = (hi >= lo_ && hi >= 0 && lo_ <= 15)
                           ? static_cast<__mmask16>(((1u << (hi + 1)) - 1) & ~((1u << lo_) - 1))
                           : static_cast<__mmask16>(0);
            any |= valid[x] != 0;
            s[r][x] = _mm512_mask_blend_ps(valid[x], neg_inf, _mm512_mul_ps(s[r][x], _mm512_set1_ps(scale)));
            vmax = _mm512_max_ps(vmax, s[r][x]);
          }
          const float tile_max = any ? _mm512_reduce_max_ps(vmax) : -std::numeric_limits<float>::infinity();
          const float new_max = std::max(m[r], tile_max);
          corr[r] = new_max == -std::numeric_limits<float>::infinity() ? 1.f : std::exp(m[r] - new_max);
          __m512 vsum = _mm512_setzero_ps();
          const __m512 nm = _mm512_set1_ps(new_max);
          for (int64_t x = 0; x < kVecs; ++x) {
            const __m512 ev = _mm512_maskz_mov_ps(valid[x], engine_cpu::exp512(_mm512_sub_ps(s[r][x], nm)));
            vsum = _mm512_add_ps(vsum, ev);
            _mm512_store_ps(&e[r][x * 16], ev);
          }
          l[r] = l[r] * corr[r] + (any ? _mm512_reduce_add_ps(vsum) : 0.f);
          m[r] = new_max;
        }
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 cv = _mm512_set1_ps(corr[r]);
          for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], cv);
        }
        const float* vf = scratch.vf.data() + t * kKeys * D;
        for (int64_t j = 0; j < kKeys; ++j) {
          __m512 v[C];
          for (int64_t c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vf + j * D + c * 16);
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512 w = _mm512_set1_ps(e[r][j]);
            for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, v[c], acc[r][c]);
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        at::BFloat16* orow = out + ((q_start + r0 + r) * num_heads + head) * D;
        for (int64_t c = 0; c < C; ++c) engine_cpu::store_bf16(orow + c * 16, _mm512_mul_ps(acc[r][c], inv));
      }
    }
  }
}

}  // namespace
#endif

// out, q: [T, H, D] bf16 contiguous; caches [num_blocks, block_size, Hkv, D]; seqs: the sequences
// (rows of block_tables / query_start_loc / context_lens) whose query rows to compute.
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                       torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                       torch::Tensor seqs, double scale, int64_t window) {
  const int64_t num_heads = q.size(1), head_size = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(prefill_kernel_supported(head_size), "prefill_attention: unsupported head size or CPU");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "contiguous tensors");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* seq = seqs.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  struct Item { int64_t b, tile, g; };
  std::vector<Item> items;
  for (int64_t s = 0; s < seqs.numel(); ++s) {
    const int64_t b = seq[s];
    for (int64_t tile = 0; tile * kQueryTile < qsl[b + 1] - qsl[b]; ++tile)
      for (int64_t g = 0; g < num_kv_heads; ++g) items.push_back({b, tile, g});
  }
  // later tiles of a sequence see more keys: deal items round-robin across threads
  const int num_threads = at::get_num_threads();
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t tid = begin; tid < end; ++tid) {
      for (size_t n = tid; n < items.size(); n += num_threads) {
        const Item& it = items[n];
        const int64_t start = qsl[it.b] + it.tile * kQueryTile;
        const int64_t rows = std::min(kQueryTile, qsl[it.b + 1] - start);
        auto run = [&](auto d) {
          prefill_item<decltype(d)::value>(
              out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(),
              value_cache.data_ptr<at::BFloat16>(), tables + it.b * max_blocks, start, rows,
              ctx[it.b] + it.tile * kQueryTile, it.g, num_heads, num_kv_heads, block_size, static_cast<float>(scale),
              window, scratch);
        };
        if (head_size == 32) run(std::integral_constant<int, 32>{});
        else if (head_size == 64) run(std::integral_constant<int, 64>{});
        else run(std::integral_constant<int, 128>{});
      }
    }
  });
#endif
}
