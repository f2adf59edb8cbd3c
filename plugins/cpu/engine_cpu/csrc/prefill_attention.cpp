// Causal attention for long prefill chunks over the packed bf16 KV cache (AVX512-BF16; on AMX
// builds, where the OS allows the tiles, each item runs amx_attention.cpp's tile kernel instead).
//
// The cache layout is packed_attention.cpp's: per (block, kv head) keys as [D/2][block_size][2]
// and values as [block_size/2][D][2], read in place. A work item is (sequence, tile of up to 64
// query rows, kv head). Query rows are processed 4 at a time so that every key load feeds 4
// independent dot products (one dpbf16 scores 16 keys against a pair of dims of one query) and
// the 4 rows' outputs stay in registers; online softmax in fp32 per 64-key tile; P @ V with the
// probabilities in bf16, one dpbf16 adding two keys' values to 16 output dims.
#include "kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

bool packed_kv_supported(int64_t head_size, int64_t block_size);
bool rows_of_heads(const torch::Tensor& t);
// amx_attention.cpp
bool amx_attention_supported(int64_t head_size);
void amx_prefill_item(at::BFloat16* out, const at::BFloat16* q, int64_t q_row, const at::BFloat16* key_cache,
                      const at::BFloat16* value_cache, const int64_t* table, int64_t q_start, int64_t rows,
                      int64_t first_pos, int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                      int64_t block_size, float scale, int64_t window, const float* sinks);

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kKeys = 64;  // keys per tile (four zmm of scores)
constexpr int64_t kVecs = kKeys / 16;
constexpr int64_t kRows = 4;   // query rows sharing each key load
constexpr int64_t kQueryTile = 64;

template <int D>
void prefill_item(at::BFloat16* out, const at::BFloat16* q, const at::BFloat16* key_cache,
                  const at::BFloat16* value_cache, const int64_t* table, int64_t q_start, int64_t rows,
                  int64_t first_pos, int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                  float scale, int64_t window, int64_t q_row, const float* sinks) {
  constexpr int64_t P = D / 2, C = D / 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t seg = block_size * D;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t k0 = lo - lo % kKeys;  // tiles start at multiples of kKeys
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < group; ++h) {
    const int64_t head = g * group + h;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t nr = std::min(kRows, rows - r0);
      const uint32_t* qrow[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        qrow[r] = reinterpret_cast<const uint32_t*>(q + (q_start + r0 + std::min(r, nr - 1)) * q_row + head * D);
      }
      __m512 acc[kRows][C];
      float m[kRows], l[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
        // a sink is one more logit in the softmax that adds no value: the running max starts at
        // it and the running sum at its exp(sink - sink) = 1
        m[r] = sinks ? sinks[head] : -std::numeric_limits<float>::infinity();
        l[r] = sinks ? 1.f : 0.f;
      }
      const int64_t row_last = first_pos + r0 + nr - 1;
      for (int64_t t = 0; t * kKeys + k0 <= row_last; ++t) {
        const int64_t tile_start = k0 + t * kKeys;
        // the tile's 16-key chunks up to the group's last row (later ones may lie in blocks not
        // allocated yet); each chunk lies in one block since block sizes are multiples of 16
        const int64_t chunks = std::min<int64_t>(kVecs, (row_last - tile_start) / 16 + 1);
        const uint32_t* kw[kVecs];
        const uint32_t* vw[kVecs];
        for (int64_t x = 0; x < kVecs; ++x) {
          const int64_t key = tile_start + 16 * std::min(x, chunks - 1);
          const int64_t base = (table[key / block_size] * num_kv_heads + g) * seg;
          kw[x] = reinterpret_cast<const uint32_t*>(key_cache + base) + key % block_size;
          vw[x] = reinterpret_cast<const uint32_t*>(value_cache + base) + (key % block_size / 2) * D;
        }
        __m512 s[kRows][kVecs];
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t x = 0; x < kVecs; ++x) s[r][x] = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; ++p) {
          __m512bh k[kVecs];
          for (int64_t x = 0; x < kVecs; ++x) k[x] = (__m512bh)_mm512_loadu_si512(kw[x] + p * block_size);
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[r][p]));
            for (int64_t x = 0; x < kVecs; ++x) s[r][x] = _mm512_dpbf16_ps(s[r][x], qp, k[x]);
          }
        }
        alignas(64) uint32_t pw[kRows][kKeys / 2];
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
            valid[x] = (x < chunks && hi >= lo_ && hi >= 0 && lo_ <= 15)
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
            _mm256_store_si256(reinterpret_cast<__m256i*>(&pw[r][x * 8]), (__m256i)_mm512_cvtneps_pbh(ev));
          }
          l[r] = l[r] * corr[r] + (any ? _mm512_reduce_add_ps(vsum) : 0.f);
          m[r] = new_max;
        }
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 cv = _mm512_set1_ps(corr[r]);
          for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], cv);
        }
        for (int64_t x = 0; x < chunks; ++x) {
          for (int64_t j = 0; j < 8; ++j) {
            __m512bh v[C];
            for (int64_t c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vw[x] + j * D + c * 16);
            for (int64_t r = 0; r < kRows; ++r) {
              const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][x * 8 + j]));
              for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, v[c]);
            }
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

// out, q: [T, H, D] bf16 contiguous; kv_cache [2, num_blocks, Hkv, block_size * D] packed; seqs:
// the sequences (rows of block_tables / query_start_loc / context_lens) whose query rows to compute;
// sinks: fp32 [H], one more logit per head in the softmax that adds no value (GPT-OSS), or empty.
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                       torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor seqs, double scale,
                       int64_t window, torch::Tensor sinks) {
  const int64_t num_heads = q.size(1), head_size = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(2), block_size = kv_cache.size(3) / head_size;
  TORCH_CHECK(packed_kv_supported(head_size, block_size), "prefill_attention: unsupported head or block size, or CPU");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "prefill_attention: bf16 only");
  TORCH_CHECK(rows_of_heads(q) && out.is_contiguous() && kv_cache.is_contiguous(),
              "prefill_attention: q rows of contiguous heads, out and kv_cache contiguous");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == num_heads),
              "prefill_attention: sinks must be fp32 [num_heads] or empty");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const float* sink_ptr = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* seq = seqs.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  const at::BFloat16* key_cache = kv_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* value_cache = key_cache + kv_cache.numel() / 2;
  struct Item { int64_t b, tile, g; };
  std::vector<Item> items;
  for (int64_t s = 0; s < seqs.numel(); ++s) {
    const int64_t b = seq[s];
    for (int64_t tile = 0; tile * kQueryTile < qsl[b + 1] - qsl[b]; ++tile)
      for (int64_t g = 0; g < num_kv_heads; ++g) items.push_back({b, tile, g});
  }
  // later tiles of a sequence see more keys: deal items round-robin across threads
  const int num_threads = at::get_num_threads();
  const bool tiles = amx_attention_supported(head_size);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tid = begin; tid < end; ++tid) {
      for (size_t n = tid; n < items.size(); n += num_threads) {
        const Item& it = items[n];
        const int64_t start = qsl[it.b] + it.tile * kQueryTile;
        const int64_t rows = std::min(kQueryTile, qsl[it.b + 1] - start);
        if (tiles) {
          amx_prefill_item(out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(), q.stride(0), key_cache,
                           value_cache, tables + it.b * max_blocks, start, rows, ctx[it.b] + it.tile * kQueryTile, it.g,
                           num_heads, num_kv_heads, head_size, block_size, static_cast<float>(scale), window,
                           sink_ptr);
          continue;
        }
        auto run = [&](auto d) {
          prefill_item<decltype(d)::value>(
              out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(), key_cache, value_cache,
              tables + it.b * max_blocks, start, rows, ctx[it.b] + it.tile * kQueryTile, it.g, num_heads,
              num_kv_heads, block_size, static_cast<float>(scale), window, q.stride(0), sink_ptr);
        };
        engine_cpu::with_head_size(head_size, run);
      }
    }
  });
#endif
}
