// Paged attention over a block-table KV cache for a flattened varlen batch, on CPU.
//
// Each query token is one work item: its heads are scored against the sequence's
// keys block by block, read in place from the cache (no gather; a block's keys for
// all kv heads are contiguous), with an online softmax accumulated in fp32.
#include "kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// q . k over head_size elements
template <typename scalar_t>
inline float dot(const scalar_t* q, const scalar_t* k, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += to_float(q[d]) * to_float(k[d]);
  return s;
}

// acc += w * v over head_size elements
template <typename scalar_t>
inline void axpy(float* acc, float w, const scalar_t* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += w * to_float(v[d]);
}

// x[i] = exp(x[i] - shift) for i < n; returns the sum
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vshift = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 e = engine_cpu::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), vshift));
    _mm512_mask_storeu_ps(x + i, mask, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <>
inline float dot<at::BFloat16>(const at::BFloat16* q, const at::BFloat16* k, int64_t n) {
  if (n % 32 != 0) {
    float s = 0.f;
    for (int64_t d = 0; d < n; ++d) s += to_float(q[d]) * to_float(k[d]);
    return s;
  }
  // bf16 x bf16 products are exact in fp32; the sums accumulate in fp32
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 32) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  }
  return _mm512_reduce_add_ps(acc);
}

template <>
inline void axpy<at::BFloat16>(float* acc, float w, const at::BFloat16* v, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d));
    __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(wv, vf, _mm512_loadu_ps(acc + d)));
  }
  for (; d < n; ++d) acc[d] += w * to_float(v[d]);
}
#endif

template <typename scalar_t>
void attend(
    scalar_t* out, const scalar_t* q, const scalar_t* key_cache, const scalar_t* value_cache,
    const int64_t* block_tables, const int64_t* query_start_loc, const int64_t* context_lens,
    const int64_t* token_seq, const int64_t* tokens, int64_t num_items, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_size, int64_t block_size, int64_t max_blocks, double scale_d, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_size;  // one token's keys (all kv heads) are contiguous
  const float scale = static_cast<float>(scale_d);
  const int num_threads = at::get_num_threads();
  // tokens are dealt round-robin so that long and short rows spread over threads
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(num_heads * head_size), scores(num_heads * block_size), m(num_heads), l(num_heads);
    for (int64_t tid = begin; tid < end; ++tid) {
      for (int64_t item = tid; item < num_items; item += num_threads) {
        const int64_t t = tokens ? tokens[item] : item;
        const int64_t b = token_seq[t];
        const int64_t pos = context_lens[b] + (t - query_start_loc[b]);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const scalar_t* qt = q + t * num_heads * head_size;
        std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.end(), 0.f);
        std::fill(acc.begin(), acc.end(), 0.f);
        const int64_t* table = block_tables + b * max_blocks;
        for (int64_t start = lo - lo % block_size; start <= pos; start += block_size) {
          const int64_t first = std::max(start, lo), last = std::min(start + block_size - 1, pos);
          const int64_t n = last - first + 1;
          const int64_t base = (table[start / block_size] * block_size + (first - start)) * row;
          // scores[h][i] = scale * q_h . k_i for query head h and its kv head h / group
          for (int64_t i = 0; i < n; ++i) {
            const scalar_t* k = key_cache + base + i * row;
            for (int64_t h = 0; h < num_heads; ++h) {
              scores[h * block_size + i] = dot(qt + h * head_size, k + (h / group) * head_size, head_size) * scale;
            }
          }
          // online softmax: rescale the running sums once per block
          for (int64_t h = 0; h < num_heads; ++h) {
            float* sh = scores.data() + h * block_size;
            const float new_max = std::max(m[h], *std::max_element(sh, sh + n));
            const float correction = std::exp(m[h] - new_max);
            float* ah = acc.data() + h * head_size;
            if (correction != 1.f) {
              l[h] *= correction;
              for (int64_t d = 0; d < head_size; ++d) ah[d] *= correction;
            }
            l[h] += exp_shifted_sum(sh, n, new_max);
            m[h] = new_max;
          }
          for (int64_t i = 0; i < n; ++i) {
            const scalar_t* v = value_cache + base + i * row;
            for (int64_t h = 0; h < num_heads; ++h) {
              axpy(acc.data() + h * head_size, scores[h * block_size + i], v + (h / group) * head_size, head_size);
            }
          }
        }
        scalar_t* ot = out + t * num_heads * head_size;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float inv = 1.f / l[h];
          for (int64_t d = 0; d < head_size; ++d) ot[h * head_size + d] = static_cast<scalar_t>(acc[h * head_size + d] * inv);
        }
      }
    }
  });
}

}  // namespace

// out, q: [T, H, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
// block_tables: [B, max_blocks]; query_start_loc: [B + 1]; context_lens: [B]; token_seq: [T] (int64);
// tokens: the token indices to compute (int64), or empty for all T. Rows of out not computed are untouched.
void paged_attention(
    torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
    torch::Tensor tokens, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: contiguous int64");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == out.scalar_type(), "dtype mismatch");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous(), "tokens: contiguous int64");
  const int64_t* token_ptr = tokens.numel() > 0 ? tokens.data_ptr<int64_t>() : nullptr;
  const int64_t num_items = token_ptr ? tokens.numel() : num_tokens;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(
        out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
        value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(),
        context_lens.data_ptr<int64_t>(), token_seq.data_ptr<int64_t>(), token_ptr, num_items, num_heads,
        num_kv_heads, head_size, block_size, block_tables.size(1), scale, window);
  });
}

// key_cache[slot_mapping[t]] = k[t], value_cache[slot_mapping[t]] = v[t] for every new token t, with
// the token rows shared out over the threads (index_copy_ runs on one); caches are [slots, Hkv, D] views.
void cache_write(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping, torch::Tensor k,
                 torch::Tensor v) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "cache_write: contiguous tensors");
  TORCH_CHECK(key_cache.scalar_type() == k.scalar_type() && value_cache.scalar_type() == v.scalar_type(),
              "cache_write: dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "cache_write: int64 slots");
  const int64_t num_tokens = k.size(0), row_bytes = k.numel() / std::max<int64_t>(num_tokens, 1) * k.element_size();
  const int64_t num_slots = key_cache.size(0);
  TORCH_CHECK(key_cache.numel() / std::max<int64_t>(num_slots, 1) * key_cache.element_size() == row_bytes,
              "cache_write: row sizes differ");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "cache_write: slot ", slots[t], " out of range");
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slots[t] * row_bytes, kp + t * row_bytes, row_bytes);
      std::memcpy(vc + slots[t] * row_bytes, vp + t * row_bytes, row_bytes);
    }
  });
}
