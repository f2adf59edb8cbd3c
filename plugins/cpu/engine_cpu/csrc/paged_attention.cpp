// Paged attention over a block-table KV cache for a flattened varlen batch, on CPU.
//
// Each (query token, kv head) pair is one work item: the queries of the kv head's
// group are scored against the sequence's keys block by block, read in place from
// the cache (no gather), with an online softmax accumulated in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

template <typename scalar_t>
void attend(
    scalar_t* out, const scalar_t* q, const scalar_t* key_cache, const scalar_t* value_cache,
    const int64_t* block_tables, const int64_t* query_start_loc, const int64_t* context_lens,
    const int64_t* token_seq, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
    int64_t block_size, int64_t max_blocks, double scale_d, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_items = num_tokens * num_kv_heads;
  const float scale = static_cast<float>(scale_d);
  const int num_threads = at::get_num_threads();
  // items are dealt round-robin so that long and short rows spread over threads
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_size), acc(group * head_size), scores(group * block_size);
    std::vector<float> vf(head_size), m(group), l(group);
    for (int64_t tid = begin; tid < end; ++tid) {
      for (int64_t item = tid; item < num_items; item += num_threads) {
        const int64_t t = item / num_kv_heads;
        const int64_t g = item % num_kv_heads;
        const int64_t b = token_seq[t];
        const int64_t pos = context_lens[b] + (t - query_start_loc[b]);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        for (int64_t h = 0; h < group; ++h) {
          const scalar_t* qh = q + (t * num_heads + g * group + h) * head_size;
          for (int64_t d = 0; d < head_size; ++d) qf[h * head_size + d] = to_float(qh[d]) * scale;
          m[h] = -std::numeric_limits<float>::infinity();
          l[h] = 0.f;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        const int64_t* table = block_tables + b * max_blocks;
        for (int64_t start = lo - lo % block_size; start <= pos; start += block_size) {
          const int64_t block = table[start / block_size];
          const int64_t first = std::max(start, lo), last = std::min(start + block_size - 1, pos);
          const int64_t n = last - first + 1;
          const int64_t base = (block * block_size + (first - start)) * num_kv_heads + g;
          // scores[h][i] = q_h . k_i
          for (int64_t i = 0; i < n; ++i) {
            const scalar_t* k = key_cache + (base + i * num_kv_heads) * head_size;
            for (int64_t h = 0; h < group; ++h) {
              const float* qh = qf.data() + h * head_size;
              float s = 0.f;
              for (int64_t d = 0; d < head_size; ++d) s += qh[d] * to_float(k[d]);
              scores[h * block_size + i] = s;
            }
          }
          // online softmax: rescale the running sums once per block
          for (int64_t h = 0; h < group; ++h) {
            float* sh = scores.data() + h * block_size;
            float block_max = *std::max_element(sh, sh + n);
            float new_max = std::max(m[h], block_max);
            float correction = std::exp(m[h] - new_max);
            l[h] *= correction;
            float* ah = acc.data() + h * head_size;
            for (int64_t d = 0; d < head_size; ++d) ah[d] *= correction;
            for (int64_t i = 0; i < n; ++i) {
              sh[i] = std::exp(sh[i] - new_max);
              l[h] += sh[i];
            }
            m[h] = new_max;
          }
          for (int64_t i = 0; i < n; ++i) {
            const scalar_t* v = value_cache + (base + i * num_kv_heads) * head_size;
            for (int64_t d = 0; d < head_size; ++d) vf[d] = to_float(v[d]);
            for (int64_t h = 0; h < group; ++h) {
              const float w = scores[h * block_size + i];
              float* ah = acc.data() + h * head_size;
              for (int64_t d = 0; d < head_size; ++d) ah[d] += w * vf[d];
            }
          }
        }
        for (int64_t h = 0; h < group; ++h) {
          scalar_t* oh = out + (t * num_heads + g * group + h) * head_size;
          const float inv = 1.f / l[h];
          for (int64_t d = 0; d < head_size; ++d) oh[d] = static_cast<scalar_t>(acc[h * head_size + d] * inv);
        }
      }
    }
  });
}

}  // namespace

// out, q: [T, H, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
// block_tables: [B, max_blocks]; query_start_loc: [B + 1]; context_lens: [B]; token_seq: [T] (int64).
void paged_attention(
    torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
    double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: contiguous int64");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == out.scalar_type(), "dtype mismatch");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(
        out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
        value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(),
        context_lens.data_ptr<int64_t>(), token_seq.data_ptr<int64_t>(), num_tokens, num_heads, num_kv_heads,
        head_size, block_size, block_tables.size(1), scale, window);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block-table KV cache (CPU)");
}
