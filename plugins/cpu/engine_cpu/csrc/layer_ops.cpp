// Fused elementwise layer ops for bf16 / fp32 activations on CPU.
//
// Each op reproduces the roundings of the torch reference in engine.layers.ops
// (each torch op on a bf16 tensor rounds to bf16), so results agree with HF
// transformers while doing one pass over memory and one call from Python.
#include "kernel.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>

#include "scalar.h"
#include "vec.h"

namespace {

using engine_cpu::load;
using engine_cpu::rounded;

// rows handled per task, 8192 elements: a few rows stay on one thread, where a fork costs more than
// the work; 64 decode rows of a 512-wide model split (add_rms_norm 13.6 -> 8.7 us on an AMX Xeon)
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* w, int64_t rows, int64_t h, int64_t x_stride, int64_t out_stride,
                   float eps) {
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      for (int64_t i = 0; i < h; ++i) {
        float v = load(xr + i);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      T* orow = out + r * out_stride;
      for (int64_t i = 0; i < h; ++i) orow[i] = static_cast<T>(load(w + i) * rounded<T>(load(xr + i) * inv));
    }
  });
}

}  // namespace

// out[r] = weight * normalise(x[r]) over the last dim; x, out: [rows, H] with unit inner stride.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "rows of [N, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  DISPATCH_F32_BF16(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), x.stride(0), out.stride(0), static_cast<float>(eps));
  });
}

// residual = x + residual; x = weight * normalise(residual). Both [N, H] contiguous, updated in place.
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "contiguous, same shape");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  DISPATCH_F32_BF16(x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const float epsf = static_cast<float>(eps);
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* xr = xp + r * h;
        scalar_t* rr = rp + r * h;
        float ss = 0.f;
        for (int64_t i = 0; i < h; ++i) {
          rr[i] = static_cast<scalar_t>(load(xr + i) + load(rr + i));
          const float v = load(rr + i);
          ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + epsf);
        for (int64_t i = 0; i < h; ++i) xr[i] = static_cast<scalar_t>(load(wp + i) * rounded<scalar_t>(load(rr + i) * inv));
      }
    });
  });
}

namespace {
// x * cos + rotate_half(x) * sin on the first rot dims of the heads of one token, rounded as the
// three torch ops would: q's q_heads heads at q, k's k_heads at k (cos, sin: the token's rot
// values, loaded once for all its heads)
template <typename T>
inline void rotate_token(T* q, int64_t q_heads, int64_t q_head, T* k, int64_t k_heads, int64_t k_head, const T* c,
                         const T* s, int64_t rot) {
  const int64_t half = rot / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    using namespace engine_cpu;
    for (; i + 16 <= half; i += 16) {
      const __m512 c1 = load_bf16(c + i), c2 = load_bf16(c + i + half);
      const __m512 s1 = load_bf16(s + i), s2 = load_bf16(s + i + half);
      auto rotate = [&](T* v) {
        const __m512 x1 = load_bf16(v + i), x2 = load_bf16(v + i + half);
        const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
        const __m512 o1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)), round_bf16(_mm512_mul_ps(neg_x2, s1)));
        const __m512 o2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)), round_bf16(_mm512_mul_ps(x1, s2)));
        store_bf16(v + i, o1);
        store_bf16(v + i + half, o2);
      };
      for (int64_t h = 0; h < q_heads; ++h) rotate(q + h * q_head);
      for (int64_t h = 0; h < k_heads; ++h) rotate(k + h * k_head);
    }
  }
#endif
  auto rest = [&](T* v) {
    for (int64_t j = i; j < half; ++j) {
      const float x1 = load(v + j), x2 = load(v + j + half);
      const float o1 = rounded<T>(x1 * load(c + j)) + rounded<T>(-x2 * load(s + j));
      const float o2 = rounded<T>(x2 * load(c + j + half)) + rounded<T>(x1 * load(s + j + half));
      v[j] = static_cast<T>(o1);
      v[j + half] = static_cast<T>(o2);
    }
  };
  if (i < half) {
    for (int64_t h = 0; h < q_heads; ++h) rest(q + h * q_head);
    for (int64_t h = 0; h < k_heads; ++h) rest(k + h * k_head);
  }
}
}  // namespace

// In place on q [T, H, D] and k [T, Hkv, D] (unit inner stride); cos, sin: [T, rotary_dim] contiguous.
// One pass over the tokens, each token's q and k heads together (its cos and sin read once).
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(), "layouts");
  TORCH_CHECK(k.size(0) == q.size(0) && cos.size(0) == q.size(0) && sin.sizes() == cos.sizes(),
              "rotary: q, k, cos and sin of the same tokens");
  const int64_t tokens = q.size(0), rot = cos.size(1);
  TORCH_CHECK(rot % 2 == 0 && rot <= q.size(2) && rot <= k.size(2), "rotary: an even rotary_dim within the heads");
  DISPATCH_F32_BF16(q.scalar_type(), "rotary", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t q_heads = q.size(1), k_heads = k.size(1);
    const int64_t q_token = q.stride(0), q_head = q.stride(1), k_token = k.stride(0), k_head = k.stride(1);
    // the bounds by value: stores through the bf16 pointers cannot then alias them
    at::parallel_for(0, tokens, grain_rows((q_heads + k_heads) * q.size(2)), [=](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        rotate_token(qp + t * q_token, q_heads, q_head, kp + t * k_token, k_heads, k_head, cp + t * rot, sp + t * rot, rot);
    });
  });
}

// out [T, d] = silu(x[:, :d]) * x[:, d:], rounded as silu then mul on the dtype.
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "contiguous");
  const int64_t d = out.size(-1), rows = out.numel() / d;
  DISPATCH_F32_BF16(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = xp + r * 2 * d;
        const scalar_t* u = g + d;
        scalar_t* o = op + r * d;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          for (; i + 16 <= d; i += 16)
            engine_cpu::store_bf16(o + i, engine_cpu::silu_mul(engine_cpu::load_bf16(g + i), engine_cpu::load_bf16(u + i)));
        }
#endif
        for (; i < d; ++i) {
          const float gv = load(g + i);
          o[i] = static_cast<scalar_t>(rounded<scalar_t>(gv / (1.f + std::exp(-gv))) * load(u + i));
        }
      }
    });
  });
}

namespace {

// first index of the maximum of x[0..n), a NaN counting as the maximum (torch.argmax)
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = n > 0 ? load(x) : 0.f;
#if defined(__AVX512F__)
  if (n >= 16) {
    auto load16 = [&](int64_t at) {
      if constexpr (std::is_same_v<T, at::BFloat16>) return engine_cpu::load_bf16(x + at);
      else return _mm512_loadu_ps(x + at);
    };
    // per lane: the largest value seen and the first index holding it (strictly greater replaces)
    __m512 vmax = load16(0);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = load16(i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(load(x + j))) return j;
    }
    best_value = _mm512_reduce_max_ps(vmax);
    const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at_max, vidx);
  }
#endif
  for (; i < n; ++i) {  // the tail (no NaN before it) or a short row
    const float v = load(x + i);
    if (std::isnan(v)) return i;
    if (v > best_value) {
      best_value = v;
      best = i;
    }
  }
  return best;
}

}  // namespace

// out[r] = argmax(logits[r]) for [N, V] contiguous fp32 or bf16 logits (greedy sampling)
void argmax(torch::Tensor out, torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "argmax: contiguous [N, V] logits");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == logits.size(0),
              "argmax: out is [N] int64");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "argmax: empty rows");
  int64_t* op = out.data_ptr<int64_t>();
  DISPATCH_F32_BF16(logits.scalar_type(), "argmax", [&] {
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * n, n);
    });
  });
}

// structured output: logits[rows[j], t] = -inf wherever bit t % 32 of bitmask[j][t / 32] is clear
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "apply_token_bitmask: contiguous [N, V] logits");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "apply_token_bitmask: contiguous [M, W] int32 bitmask");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong &&
                  rows.numel() == bitmask.size(0),
              "apply_token_bitmask: rows is [M] int64");
  const int64_t n = logits.size(1), words = bitmask.size(1), count = rows.numel(), num_rows = logits.size(0);
  TORCH_CHECK(words * 32 >= n, "apply_token_bitmask: the bitmask is narrower than the vocabulary");
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < count; ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < num_rows, "apply_token_bitmask: row out of range");
  DISPATCH_F32_BF16(logits.scalar_type(), "apply_token_bitmask", [&] {
    scalar_t* xp = logits.data_ptr<scalar_t>();
    const scalar_t ninf = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
    at::parallel_for(0, count, 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        scalar_t* x = xp + rp[j] * n;
        const uint32_t* m = reinterpret_cast<const uint32_t*>(mp + j * words);
        int64_t w = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // 32 tokens a word: one 64-byte blend of bf16 logits, or two of fp32, under the word as a mask
        for (; (w + 1) * 32 <= n; ++w) {
          const uint32_t word = m[w];
          if (word == 0xFFFFFFFFu) continue;
          scalar_t* p = x + w * 32;
          if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
            const __m512i keep = _mm512_loadu_si512(p);
            _mm512_storeu_si512(p, _mm512_mask_blend_epi16(word, _mm512_set1_epi16(static_cast<int16_t>(0xFF80)), keep));
          } else {
            const __m512 ninf16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            _mm512_storeu_ps(p, _mm512_mask_blend_ps(static_cast<__mmask16>(word), ninf16, _mm512_loadu_ps(p)));
            _mm512_storeu_ps(p + 16, _mm512_mask_blend_ps(static_cast<__mmask16>(word >> 16), ninf16, _mm512_loadu_ps(p + 16)));
          }
        }
#endif
        for (; w * 32 < n; ++w) {
          const uint32_t word = m[w];
          if (word == 0xFFFFFFFFu) continue;
          const int64_t base = w * 32, end = std::min<int64_t>(32, n - base);
          for (int64_t t = 0; t < end; ++t) x[base + t] = ((word >> t) & 1u) ? x[base + t] : ninf;
        }
      }
    });
  });
}
