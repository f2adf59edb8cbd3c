// Paged attention over the packed bf16 KV cache (AVX512-BF16): decode tokens and short chunks.
//
// Packed layout (kv_cache [2, num_blocks, Hkv, block_size * D]): one block's keys of one kv
// head form a segment laid out as [D/2][block_size][2], so 16 consecutive keys' values of one
// pair of dims fill a zmm and one dpbf16 scores 16 keys against a pair of query dims (no
// horizontal sums); values as [block_size/2][D][2], so one dpbf16 adds two keys' values,
// weighted by their bf16 probabilities, to 16 output dims (P in bf16, as the softmax output
// is rounded before P @ V in the model's own dtype). A work item is a query token (or, when
// there are few, a range of its kv heads): it streams the segments of its heads block by block,
// each read prefetching (into L1) the same line of the segment it reads next, 2 KB on for a
// 64-dim head, through the block table: hardware prefetchers stop at 4 KB pages and cannot
// follow a jump between blocks, and a software stream this far ahead reads faster than theirs
// even where the blocks are contiguous (W2's decode attention on an Intel Xeon with AMX: 26.4
// -> 29.7 GB/s; farther ahead, 4 KB, is slower).
#include "kernel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

// [T, H, D] with each token's heads contiguous (any stride between tokens: q, k and v may be
// column slices of one fused projection)
bool rows_of_heads(const torch::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2));
}

bool packed_kv_supported(int64_t head_size, int64_t block_size) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const bool head_ok = head_size == 16 || head_size == 32 || head_size == 64 || head_size == 128 || head_size == 256;
  return head_ok && block_size > 0 && block_size % 16 == 0;
#else
  (void)head_size;
  (void)block_size;
  return false;
#endif
}

namespace {

// Writes one token's K and V rows of kv heads [h0, h1) into its slot (block, off) of the packed
// cache halves kc, vc (segments of seg elements): each key pair to its row of the segment, each
// value into the even or odd half of its (even, odd) key pair, leaving the other half alone
// (another thread may be writing the pair's other token).
inline void write_token_heads(uint16_t* kc, uint16_t* vc, int64_t seg, int64_t block_size, int64_t num_kv_heads,
                              int64_t head_size, int64_t block, int64_t off, int64_t h0, int64_t h1,
                              const uint16_t* k_heads, const uint16_t* v_heads) {
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t base = (block * num_kv_heads + h) * seg;
    const uint16_t* krow = k_heads + h * head_size;
    const uint16_t* vrow = v_heads + h * head_size;
    uint32_t* kseg = reinterpret_cast<uint32_t*>(kc + base);  // [D/2][bs] pairs
    uint16_t* vpairs = vc + base + (off / 2) * 2 * head_size;  // [D][2] of keys off & ~1, off | 1
    int64_t p = 0, d = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (head_size % 32 == 0) {
      // 16 key pairs (dims 2p..2p+31) to rows p..p+15 of the segment, column off
      const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(block_size)));
      for (; p < head_size / 2; p += 16)
        _mm512_i32scatter_epi32(kseg + p * block_size + off, rows, _mm512_loadu_si512(krow + 2 * p), 4);
      const __mmask32 half = (off & 1) ? 0xAAAAAAAAu : 0x55555555u;
      for (; d + 16 <= head_size; d += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + d)));
        if (off & 1) w = _mm512_slli_epi32(w, 16);
        _mm512_mask_storeu_epi16(vpairs + 2 * d, half, w);
      }
    }
#endif
    for (; p < head_size / 2; ++p) {
      uint32_t pair;
      std::memcpy(&pair, krow + 2 * p, sizeof(pair));
      kseg[p * block_size + off] = pair;
    }
    for (; d < head_size; ++d) vpairs[2 * d + (off & 1)] = vrow[d];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// Writes the K and V rows of 16 tokens (rows k_row / v_row apart; head_size a multiple of 32,
// k_row even) into slots off..off+15 of `block` (off a multiple of 16), every kv head: row p of
// a key segment gets the 16 tokens' pair p (one gather), and each value pair of tokens its [D][2]
// interleave; every store a full line of the run's own.
inline void write_run_heads(uint16_t* kc, uint16_t* vc, int64_t seg, int64_t block_size, int64_t num_kv_heads,
                            int64_t head_size, int64_t block, int64_t off, const uint16_t* k_rows,
                            const uint16_t* v_rows, int64_t k_row, int64_t v_row) {
  const __m512i token_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(static_cast<int>(k_row / 2)));
  // word 2i of a pair's 16 dims is dim i of the even token (a), word 2i + 1 the odd one's (b)
  alignas(64) uint16_t interleave[32];
  for (int i = 0; i < 16; ++i) {
    interleave[2 * i] = static_cast<uint16_t>(i);
    interleave[2 * i + 1] = static_cast<uint16_t>(32 + i);
  }
  const __m512i low_dims = _mm512_load_si512(interleave);
  const __m512i high_dims = _mm512_add_epi16(low_dims, _mm512_set1_epi16(16));
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t base = (block * num_kv_heads + h) * seg;
    uint32_t* kseg = reinterpret_cast<uint32_t*>(kc + base) + off;  // pair p of the run: kseg + p * block_size
    const int* keys = reinterpret_cast<const int*>(k_rows + h * head_size);
    for (int64_t p = 0; p < head_size / 2; ++p)
      _mm512_storeu_si512(kseg + p * block_size, _mm512_i32gather_epi32(token_rows, keys + p, 4));
    uint16_t* vpairs = vc + base + off * head_size;  // 8 pairs of tokens, [D][2] each
    for (int64_t j = 0; j < 8; ++j) {
      const uint16_t* even = v_rows + 2 * j * v_row + h * head_size;
      const uint16_t* odd = even + v_row;
      uint16_t* dst = vpairs + 2 * j * head_size;
      for (int64_t d = 0; d < head_size; d += 32) {
        const __m512i a = _mm512_loadu_si512(even + d), b = _mm512_loadu_si512(odd + d);
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, low_dims, b));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, high_dims, b));
      }
    }
  }
}
#endif

// every slot of a step's tokens inside a cache of `capacity` slots
inline void check_slots(const char* kernel, const int64_t* slots, int64_t num_tokens, int64_t capacity) {
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, kernel, ": slot ", slots[t], " out of range");
}

}  // namespace

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int kScoreChunks = 4;  // 16-key chunks scored together (pass 1)

inline void prefetch_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// Per-thread scratch of decode_item: scores and probabilities of every key of an item's heads,
// and the heads' fp32 outputs.
struct DecodeScratch {
  std::vector<float> scores;     // [heads][span] scaled q.k (-inf outside the item's keys)
  std::vector<uint16_t> probs;   // [heads][span] bf16 exp(score - max)
  std::vector<float> acc, vmax;  // [heads][D], [heads][16]
};

// Attention of the query heads of kv heads [g0, g1) (query heads [g0 * group, g1 * group)) of
// one token at position pos over keys [lo, pos] of its sequence; the caches are the K and V
// halves of the packed cache. Three passes, none waiting on another key's softmax: all scores
// (K streamed block by block, the segments of [g0, g1) of a block read as one piece), then each
// head's max, exponentials and sum, then P @ V (V streamed the same way). The scores of one
// item (heads x keys x 4 bytes) stay in L2.
template <int D>
void decode_item(at::BFloat16* out, const at::BFloat16* q, const at::BFloat16* key_cache,
                 const at::BFloat16* value_cache, const int64_t* table, int64_t pos, int64_t lo, int64_t g0,
                 int64_t g1, int64_t group, int64_t num_kv_heads, int64_t block_size, float scale,
                 const float* sinks, DecodeScratch& scratch) {
  constexpr int64_t P = D / 2, C = D / 16;
  static_assert(P % 4 == 0, "head sizes are multiples of 8");
  const int64_t seg = block_size * D, heads = (g1 - g0) * group;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t first_block = lo / block_size, last_block = pos / block_size;
  const int64_t key0 = first_block * block_size, span = (last_block + 1) * block_size - key0;
  if (static_cast<int64_t>(scratch.scores.size()) < heads * span) {
    scratch.scores.resize(heads * span);
    scratch.probs.resize(heads * span);
  }
  scratch.acc.assign(heads * D, 0.f);
  scratch.vmax.assign(heads * 16, -std::numeric_limits<float>::infinity());
  float* scores = scratch.scores.data();
  uint16_t* probs = scratch.probs.data();
  float* acc_mem = scratch.acc.data();
  float* vmax = scratch.vmax.data();
  // the 16-key chunks holding keys [lo, pos], and each chunk's valid lanes
  const int64_t chunk_lo = lo / 16 * 16, chunk_hi = pos / 16 * 16;
  auto valid_lanes = [&](int64_t chunk) {
    const int64_t hi = std::min<int64_t>(15, pos - chunk), lane_lo = std::max<int64_t>(0, lo - chunk);
    return static_cast<__mmask16>(((1u << (hi + 1)) - 1) & ~((1u << lane_lo) - 1));
  };
  // the segment of kv head g holding the 16-key chunk at `chunk`, as k-pairs
  auto segment = [&](const at::BFloat16* cache, int64_t chunk, int64_t g) {
    return reinterpret_cast<const uint32_t*>(cache + (table[chunk / block_size] * num_kv_heads + g) * seg);
  };
  // pass 1: scores, kScoreChunks 16-key chunks at a time: each broadcast query pair feeds the
  // chunks' products (4 accumulators a chunk, pair p to accumulator p % 4, so a key's score
  // sums its pairs in the same order however the chunks are grouped)
  for (int64_t chunk0 = chunk_lo; chunk0 <= chunk_hi; chunk0 += 16 * kScoreChunks) {
    const int nc = static_cast<int>(std::min<int64_t>(kScoreChunks, (chunk_hi - chunk0) / 16 + 1));
    int64_t offset_of[kScoreChunks];
    for (int i = 0; i < nc; ++i) offset_of[i] = (chunk0 + 16 * i) % block_size;
    for (int64_t g = g0; g < g1; ++g) {
      const uint32_t* kw[kScoreChunks];  // pair p of key o+i of chunk c: kw[c][p*bs+i]
      const uint32_t* kn[kScoreChunks];  // what chunk c reads next: head g + 1, or the next group's first head
      for (int i = 0; i < nc; ++i) {
        const int64_t chunk = chunk0 + 16 * i, later = chunk + 16 * kScoreChunks;
        kw[i] = segment(key_cache, chunk, g) + offset_of[i];
        kn[i] = g + 1 < g1         ? segment(key_cache, chunk, g + 1) + offset_of[i]
                : later <= chunk_hi ? segment(key_cache, later, g0) + later % block_size
                                    : kw[i];
      }
      for (int64_t h = (g - g0) * group; h < (g - g0 + 1) * group; ++h) {
        const uint32_t* qw = reinterpret_cast<const uint32_t*>(q + h * D);
        auto score = [&](auto chunks) {
          constexpr int NC = decltype(chunks)::value;
          __m512 s[NC][4];
          for (int i = 0; i < NC; ++i)
            for (int u = 0; u < 4; ++u) s[i][u] = _mm512_setzero_ps();
          for (int64_t p = 0; p < P; p += 4) {
            for (int u = 0; u < 4; ++u) {
              const __m512bh xq = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[p + u]));
              for (int i = 0; i < NC; ++i)
                s[i][u] = _mm512_dpbf16_ps(s[i][u], xq, (__m512bh)_mm512_loadu_si512(kw[i] + (p + u) * block_size));
              if (h == (g - g0) * group)  // the head group's first query head: once per line of K
                for (int i = 0; i < NC; ++i) prefetch_line(kn[i] + (p + u) * block_size);
            }
          }
          __m512 m = _mm512_loadu_ps(vmax + h * 16);
          for (int i = 0; i < NC; ++i) {
            const int64_t chunk = chunk0 + 16 * i;
            __m512 t = _mm512_add_ps(_mm512_add_ps(s[i][0], s[i][1]), _mm512_add_ps(s[i][2], s[i][3]));
            t = _mm512_mask_blend_ps(valid_lanes(chunk), neg_inf, _mm512_mul_ps(t, vscale));
            _mm512_storeu_ps(scores + h * span + (chunk - key0), t);
            m = _mm512_max_ps(m, t);
          }
          _mm512_storeu_ps(vmax + h * 16, m);
        };
        switch (nc) {
          case 4: score(std::integral_constant<int, 4>{}); break;
          case 3: score(std::integral_constant<int, 3>{}); break;
          case 2: score(std::integral_constant<int, 2>{}); break;
          default: score(std::integral_constant<int, 1>{}); break;
        }
      }
    }
  }
  // the 16 keys' values of one head at `chunk` (as [8][D] value pairs), all prefetched at once
  auto value_pairs = [&](int64_t chunk, int64_t g) { return segment(value_cache, chunk, g) + (chunk % block_size / 2) * D; };
  auto prefetch_values = [&](const uint32_t* pairs) {
    for (int64_t line = 0; line < 8 * D * 4; line += 64) prefetch_line(reinterpret_cast<const char*>(pairs) + line);
  };
  prefetch_values(value_pairs(chunk_lo, g0));
  // pass 2: probabilities (bf16, as the softmax output is rounded before P @ V in the model's
  // dtype) and each head's sum of the unrounded ones
  std::vector<float>& l = scratch.vmax;  // reused: head h's sum in l[h * 16] once its max is read
  for (int64_t h = 0; h < heads; ++h) {
    // a sink (sinks[h], this item's heads) is one more logit that adds no value: in the max and the sum
    const float keys_max = _mm512_reduce_max_ps(_mm512_loadu_ps(vmax + h * 16));
    const float head_max = sinks ? std::max(keys_max, sinks[h]) : keys_max;
    const __m512 mx = _mm512_set1_ps(head_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t chunk = chunk_lo; chunk <= chunk_hi; chunk += 16) {
      const int64_t i = h * span + (chunk - key0);
      const __m512 e =
          _mm512_maskz_mov_ps(valid_lanes(chunk), engine_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), mx)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + i), (__m256i)_mm512_cvtneps_pbh(e));
    }
    l[h * 16] = _mm512_reduce_add_ps(sum) + (sinks ? std::exp(sinks[h] - head_max) : 0.f);
  }
  // pass 3: P @ V (its first values prefetched before pass 2, which reads no memory); a head's
  // values of a chunk prefetch, line by line as they are read (by the head group's first query
  // head), the same lines of the next head's, the last head's of the next chunk's first head's
  // (all of a head's lines at its start instead: 29.9 -> 30.9 GB/s with the interleave, W2-like
  // step on an Intel Xeon with AMX)
  for (int64_t n = first_block; n <= last_block; ++n) {
    const int64_t block_start = n * block_size;
    for (int64_t o = 0; o < block_size; o += 16) {
      const int64_t chunk = block_start + o;
      if (chunk > pos) break;
      if (chunk < chunk_lo) continue;
      const int64_t hi = std::min<int64_t>(15, pos - chunk), lane_lo = std::max<int64_t>(0, lo - chunk);
      const int64_t pair_lo = lane_lo / 2, pair_hi = hi / 2;
      for (int64_t g = g0; g < g1; ++g) {
        const uint32_t* vw = value_pairs(chunk, g);  // pair j: vw + j*D
        const char* next = reinterpret_cast<const char*>(g + 1 < g1            ? value_pairs(chunk, g + 1)
                                                         : chunk + 16 <= pos ? value_pairs(chunk + 16, g0)
                                                                             : nullptr);
        for (int64_t h = (g - g0) * group; h < (g - g0 + 1) * group; ++h) {
          const bool prefetches = next != nullptr && h == (g - g0) * group;
          const uint32_t* pw = reinterpret_cast<const uint32_t*>(probs + h * span + (chunk - key0));
          float* acc_h = acc_mem + h * D;
          __m512 acc[C];
          for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_loadu_ps(acc_h + c * 16);
          for (int64_t j = pair_lo; j <= pair_hi; ++j) {
            if (prefetches)
              for (int64_t c = 0; c < C; ++c) prefetch_line(next + (j * D + c * 16) * sizeof(uint32_t));
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[j]));
            for (int64_t c = 0; c < C; ++c)
              acc[c] = _mm512_dpbf16_ps(acc[c], w, (__m512bh)_mm512_loadu_si512(vw + j * D + c * 16));
          }
          for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc_h + c * 16, acc[c]);
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / l[h * 16]);
    for (int64_t c = 0; c < C; ++c)
      engine_cpu::store_bf16(out + h * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc_mem + h * D + c * 16), inv));
  }
}

}  // namespace
#endif

namespace {

// A decode step's new keys and values ([T, Hkv, D] bf16 rows, any stride between tokens) and
// their cache slots, which decode_attention_packed writes as it attends.
struct NewTokens {
  const uint16_t* k;
  const uint16_t* v;
  int64_t k_row, v_row;
  const int64_t* slots;
};

void attend_packed(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                   torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
                   torch::Tensor tokens, double scale, int64_t window, torch::Tensor sinks, const NewTokens* fresh) {
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(2), block_size = kv_cache.size(3) / head_size;
  TORCH_CHECK(packed_kv_supported(head_size, block_size), "paged_attention_packed: unsupported head or block size");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "paged_attention_packed: bf16 only");
  TORCH_CHECK(rows_of_heads(q) && out.is_contiguous() && kv_cache.is_contiguous(),
              "paged_attention_packed: q rows of contiguous heads, out and kv_cache contiguous");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous(), "tokens: contiguous int64");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == num_heads),
              "paged_attention_packed: sinks must be fp32 [num_heads] or empty");
  (void)fresh;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const float* sink_ptr = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const int64_t* token_ptr = tokens.numel() > 0 ? tokens.data_ptr<int64_t>() : nullptr;
  const int64_t num_rows = token_ptr ? tokens.numel() : num_tokens;
  const int64_t group = num_heads / num_kv_heads;
  const int num_threads = at::get_num_threads();
  // an item is (row, range of kv heads): whole rows stream each block's segments in one piece;
  // rows are split by kv heads when there are too few of them to balance the threads
  const int64_t wanted = 8 * num_threads;
  const int64_t splits = std::clamp<int64_t>((wanted + num_rows - 1) / std::max<int64_t>(num_rows, 1), 1, num_kv_heads);
  const int64_t heads_per_item = (num_kv_heads + splits - 1) / splits;
  const int64_t items_per_row = (num_kv_heads + heads_per_item - 1) / heads_per_item;
  const int64_t num_items = num_rows * items_per_row;
  const int64_t max_blocks = block_tables.size(1);
  at::BFloat16* key_cache = kv_cache.data_ptr<at::BFloat16>();
  at::BFloat16* value_cache = key_cache + kv_cache.numel() / 2;
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* seq_of = token_seq.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  at::BFloat16* out_ptr = out.data_ptr<at::BFloat16>();
  const at::BFloat16* q_ptr = q.data_ptr<at::BFloat16>();
  const int64_t q_row = q.stride(0);
  const float fscale = static_cast<float>(scale);
  auto position = [&](int64_t row) {
    const int64_t t = token_ptr ? token_ptr[row] : row;
    return ctx[seq_of[t]] + (t - qsl[seq_of[t]]);
  };
  // longest rows first, taken by whichever thread is free (a row's cost is its key count)
  std::vector<int64_t> order(num_rows);
  for (int64_t row = 0; row < num_rows; ++row) order[row] = row;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return position(a) > position(b); });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    DecodeScratch scratch;
    for (int64_t tid = begin; tid < end; ++tid) {
      for (int64_t item = next++; item < num_items; item = next++) {
        const int64_t row = order[item / items_per_row], g0 = item % items_per_row * heads_per_item;
        const int64_t g1 = std::min(num_kv_heads, g0 + heads_per_item);
        const int64_t t = token_ptr ? token_ptr[row] : row;
        const int64_t b = seq_of[t];
        const int64_t pos = ctx[b] + (t - qsl[b]);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const int64_t offset = (t * num_heads + g0 * group) * head_size;
        const int64_t q_offset = t * q_row + g0 * group * head_size;
        if (fresh != nullptr) {  // the token's own keys and values first: the item reads them last
          const int64_t slot = fresh->slots[t];
          write_token_heads(reinterpret_cast<uint16_t*>(key_cache), reinterpret_cast<uint16_t*>(value_cache),
                            block_size * head_size, block_size, num_kv_heads, head_size, slot / block_size,
                            slot % block_size, g0, g1, fresh->k + t * fresh->k_row, fresh->v + t * fresh->v_row);
        }
        auto run = [&](auto d) {
          decode_item<decltype(d)::value>(out_ptr + offset, q_ptr + q_offset, key_cache, value_cache,
                                          tables + b * max_blocks, pos, lo, g0, g1, group, num_kv_heads, block_size,
                                          fscale, sink_ptr ? sink_ptr + g0 * group : nullptr, scratch);
        };
        engine_cpu::with_head_size(head_size, run);
      }
    }
  });
#endif
}

}  // namespace

// out, q: [T, H, D] bf16; kv_cache: [2, num_blocks, Hkv, block_size * D] packed; tokens: the token
// rows to compute (int64), or empty for all T. Rows of out not computed are untouched.
void paged_attention_packed(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
                            torch::Tensor tokens, double scale, int64_t window, torch::Tensor sinks) {
  attend_packed(out, q, kv_cache, block_tables, query_start_loc, context_lens, token_seq, tokens, scale, window, sinks,
                nullptr);
}

// A decode step (every sequence one new token): writes each token's k and v ([T, Hkv, D] bf16)
// into its slot and attends, in one pass over the work items: the item of a token and its kv
// heads writes them before it streams the token's blocks, whose last one it then reads from the
// cache the writes just brought in, instead of a separate pass writing lines that miss.
void decode_attention_packed(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                             torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                             torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
                             double scale, int64_t window, torch::Tensor sinks) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "decode_attention_packed: kv_cache [2, blocks, Hkv, bs * D] contiguous");
  TORCH_CHECK(rows_of_heads(k) && rows_of_heads(v) && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "decode_attention_packed: k and v bf16 rows of contiguous heads");
  const int64_t num_tokens = q.size(0), num_kv_heads = kv_cache.size(2), head_size = q.size(2);
  TORCH_CHECK(k.size(0) == num_tokens && v.size(0) == num_tokens && k.size(1) == num_kv_heads &&
                  v.size(1) == num_kv_heads && k.size(2) == head_size && v.size(2) == head_size,
              "decode_attention_packed: k and v [T, Hkv, D] as q and the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == num_tokens, "decode_attention_packed: an int64 slot a token");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.numel() == num_tokens + 1,
              "decode_attention_packed: one token a sequence");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0, "decode_attention_packed: query_start_loc starts at 0");
  for (int64_t b = 0; b < num_tokens; ++b)
    TORCH_CHECK(qsl[b + 1] - qsl[b] == 1, "decode_attention_packed: sequence ", b, " has ", qsl[b + 1] - qsl[b],
                " new tokens; a decode step has one a sequence");
  TORCH_CHECK(head_size > 0 && kv_cache.size(3) % head_size == 0, "decode_attention_packed: cache and q shapes differ");
  const int64_t block_size = kv_cache.size(3) / head_size, capacity = kv_cache.size(1) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  check_slots("decode_attention_packed", slots, num_tokens, capacity);
  const NewTokens fresh{reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), k.stride(0), v.stride(0), slots};
  attend_packed(out, q, kv_cache, block_tables, query_start_loc, context_lens, token_seq,
                slot_mapping.slice(0, 0, 0), scale, window, sinks, &fresh);  // no token list: every row
}

// Writes the new tokens' K and V ([T, Hkv, D] bf16) into their slots of the packed cache, with
// the tokens shared out over the threads.
void cache_write_packed(torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2, "cache_write_packed: kv_cache [2, blocks, Hkv, bs * D]");
  TORCH_CHECK(kv_cache.is_contiguous() && rows_of_heads(k) && rows_of_heads(v),
              "cache_write_packed: kv_cache contiguous, k and v rows of contiguous heads");
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "cache_write_packed: bf16 only");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "cache_write_packed: int64 slots");
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_size = k.size(2);
  TORCH_CHECK(kv_cache.size(2) == num_kv_heads && kv_cache.size(3) % head_size == 0 && head_size % 2 == 0,
              "cache_write_packed: cache and k/v shapes differ");
  const int64_t block_size = kv_cache.size(3) / head_size, num_blocks = kv_cache.size(1);
  TORCH_CHECK(block_size % 2 == 0, "cache_write_packed: even block size");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  check_slots("cache_write_packed", slots, num_tokens, num_blocks * block_size);
  const int64_t seg = block_size * head_size, half = kv_cache.numel() / 2;
  auto* kc = reinterpret_cast<uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  auto* vc = kc + half;
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t k_row = k.stride(0), v_row = v.stride(0);
  // A prompt's tokens fill whole 16-slot runs of its blocks (block sizes are multiples of 16):
  // each such run is written as full lines, its keys transposed by gathers and its values
  // interleaved in registers, instead of token by token (a token's key pairs go to 32 lines
  // of their own): half the time for W2's prompts. Other tokens (a decode step's, a run cut
  // by the chunk's ends) are written one at a time; both are shared out over the threads.
  std::vector<int64_t> units;  // the first token of each unit (a run of 16, or one token), then T
  units.reserve(num_tokens / 16 + 16);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const bool runs_ok = head_size % 32 == 0 && k_row % 2 == 0;
#else
  const bool runs_ok = false;
#endif
  for (int64_t t = 0; t < num_tokens;) {
    units.push_back(t);
    bool run = runs_ok && slots[t] % 16 == 0 && t + 16 <= num_tokens;
    for (int64_t i = 1; run && i < 16; ++i) run = slots[t + i] == slots[t] + i;
    t += run ? 16 : 1;
  }
  const int64_t num_units = static_cast<int64_t>(units.size());
  units.push_back(num_tokens);
  at::parallel_for(0, num_units, 4, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t0 = units[u];
      if (units[u + 1] - t0 == 1) {
        write_token_heads(kc, vc, seg, block_size, num_kv_heads, head_size, slots[t0] / block_size,
                          slots[t0] % block_size, 0, num_kv_heads, kp + t0 * k_row, vp + t0 * v_row);
        continue;
      }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      write_run_heads(kc, vc, seg, block_size, num_kv_heads, head_size, slots[t0] / block_size, slots[t0] % block_size,
                      kp + t0 * k_row, vp + t0 * v_row, k_row, v_row);
#endif
    }
  });
}
