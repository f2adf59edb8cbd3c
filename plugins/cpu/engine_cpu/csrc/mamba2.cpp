// The Mamba-2 scan's kernels (engine_cpu/mamba2.py). For the chunked form, its elementwise
// passes: the short convolution written per chunk head-major, the decayed causal scores within
// a chunk, the pass of the states across chunks, and the sum of a chunk's outputs gathered to
// the step's token rows; the matmuls between them stay torch's (torch.bmm). For decode, the
// whole step in place on the state slots. The inputs are fp32 or bf16; everything after the
// convolution's rounding is float32.
#include "kernel.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "scalar.h"
#include "vec.h"

namespace {

using engine_cpu::load;
using engine_cpu::rounded;

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

}  // namespace

// x [B, c, H, l, P], b and c [B, c, G, l, N] (float32) = SiLU(the causal depthwise convolution
// of each sequence's [kept; new] inputs + bias), rounded to xbc's dtype; row r of
// sequence s convolves positions r .. r + K - 1 of [kept (K - 1 rows); its new tokens; zeros].
// xbc [T, C]; kept [B, K - 1, C] float32; weight [K, C] float32 (transposed); bias [C] float32
// or empty; query_start_loc [B + 1], query_lens [B] int64.
void mamba2_conv(torch::Tensor x_out, torch::Tensor b_out, torch::Tensor c_out, torch::Tensor xbc,
                 torch::Tensor kept, torch::Tensor weight, torch::Tensor bias, torch::Tensor query_start_loc,
                 torch::Tensor query_lens) {
  TORCH_CHECK(x_out.is_contiguous() && b_out.is_contiguous() && c_out.is_contiguous() && xbc.is_contiguous() &&
                  kept.is_contiguous() && weight.is_contiguous() && bias.is_contiguous(),
              "mamba2_conv: contiguous tensors");
  TORCH_CHECK(x_out.scalar_type() == at::kFloat && b_out.scalar_type() == at::kFloat &&
                  c_out.scalar_type() == at::kFloat && kept.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && (bias.numel() == 0 || bias.scalar_type() == at::kFloat),
              "mamba2_conv: outputs, kept, weight and bias float32");
  const int64_t seqs = x_out.size(0), chunks = x_out.size(1), heads = x_out.size(2), length = x_out.size(3),
                head_size = x_out.size(4), groups = b_out.size(2), state_size = b_out.size(4);
  const int64_t channels = xbc.size(1), kernel = weight.size(0), width = kernel - 1;
  TORCH_CHECK(channels == heads * head_size + 2 * groups * state_size && kept.size(1) == width &&
                  weight.size(1) == channels,
              "mamba2_conv: channel counts");
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const float* kp = kept.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t x_channels = heads * head_size, bc_channels = groups * state_size;
  DISPATCH_F32_BF16(xbc.scalar_type(), "mamba2_conv", [&] {
    const scalar_t* in = xbc.data_ptr<scalar_t>();
    float* xo = x_out.data_ptr<float>();
    float* bo = b_out.data_ptr<float>();
    float* co = c_out.data_ptr<float>();
    // one task a (sequence, chunk): its rows' inputs in float32 once, then the K taps per channel
    at::parallel_for(0, seqs * chunks, 1, [&](int64_t task_begin, int64_t task_end) {
      std::vector<float> window((length + width) * channels);
      std::vector<float> act(channels);
      for (int64_t task = task_begin; task < task_end; ++task) {
        const int64_t s = task / chunks, chunk = task % chunks;
        for (int64_t i = 0; i < length + width; ++i) {
          const int64_t pos = chunk * length + i;  // in [kept; new; zeros]
          float* row = window.data() + i * channels;
          if (pos < width) {
            std::memcpy(row, kp + (s * width + pos) * channels, channels * sizeof(float));
          } else if (pos - width < lens[s]) {
            const scalar_t* src = in + (starts[s] + pos - width) * channels;
            int64_t ch = 0;
#if defined(__AVX512F__)
            if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
              for (; ch + 16 <= channels; ch += 16) _mm512_storeu_ps(row + ch, engine_cpu::load_bf16(src + ch));
            }
#endif
            for (; ch < channels; ++ch) row[ch] = load(src + ch);
          } else {
            std::memset(row, 0, channels * sizeof(float));
          }
        }
        for (int64_t i = 0; i < length; ++i) {
          const float* rows = window.data() + i * channels;
          int64_t ch = 0;
#if defined(__AVX512F__)
          const __m512 one = _mm512_set1_ps(1.f);
          for (; ch + 16 <= channels; ch += 16) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t k = 0; k < kernel; ++k) {
              sum = _mm512_fmadd_ps(_mm512_loadu_ps(rows + k * channels + ch), _mm512_loadu_ps(wp + k * channels + ch),
                                    sum);
            }
            if (bp) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bp + ch));
            const __m512 e = engine_cpu::exp512(_mm512_sub_ps(_mm512_setzero_ps(), sum));
            __m512 v = _mm512_div_ps(sum, _mm512_add_ps(one, e));  // SiLU
            if constexpr (std::is_same_v<scalar_t, at::BFloat16>) v = engine_cpu::round_bf16(v);
            _mm512_storeu_ps(act.data() + ch, v);
          }
#endif
          for (; ch < channels; ++ch) {
            float sum = 0.f;
            for (int64_t k = 0; k < kernel; ++k) sum += rows[k * channels + ch] * wp[k * channels + ch];
            if (bp) sum += bp[ch];
            act[ch] = rounded<scalar_t>(silu(sum));
          }
          const int64_t base = s * chunks + chunk;
          for (int64_t h = 0; h < heads; ++h) {
            float* dst = xo + ((base * heads + h) * length + i) * head_size;
            const float* src = act.data() + h * head_size;
            std::memcpy(dst, src, head_size * sizeof(float));
          }
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t offset = ((base * groups + g) * length + i) * state_size;
            const float* bs = act.data() + x_channels + g * state_size;
            std::memcpy(bo + offset, bs, state_size * sizeof(float));
            std::memcpy(co + offset, bs + bc_channels, state_size * sizeof(float));
          }
        }
      }
    });
  });
}

// scores [B, c, H, l, l] = cb[g(h)]_ij exp(cum_i - cum_j) delta_j for j <= i, 0 above and where
// cum_i - cum_j < log_floor (a decay too small to matter, kept out of the matmuls as a
// denormal). cb [B, c, G, l, l]; cumulative and delta [B, c, H, l]; all float32.
void mamba2_chunk_scores(torch::Tensor scores, torch::Tensor cb, torch::Tensor cumulative, torch::Tensor delta,
                         double log_floor) {
  TORCH_CHECK(scores.is_contiguous() && cb.is_contiguous() && cumulative.is_contiguous() && delta.is_contiguous(),
              "mamba2_chunk_scores: contiguous tensors");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && cb.scalar_type() == at::kFloat &&
                  cumulative.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat,
              "mamba2_chunk_scores: float32 tensors");
  const int64_t seqs = scores.size(0), chunks = scores.size(1), heads = scores.size(2), length = scores.size(3);
  const int64_t groups = cb.size(2), per_group = heads / groups;
  const float* cum = cumulative.data_ptr<float>();
  const float* dl = delta.data_ptr<float>();
  const float* cbp = cb.data_ptr<float>();
  float* out = scores.data_ptr<float>();
  const float least = static_cast<float>(log_floor);
  at::parallel_for(0, seqs * chunks * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % heads, sc = task / heads;
      const float* a = cum + task * length;
      const float* d = dl + task * length;
      const float* m = cbp + (sc * groups + h / per_group) * length * length;
      float* o = out + task * length * length;
      for (int64_t i = 0; i < length; ++i) {
        const float* mi = m + i * length;
        float* oi = o + i * length;
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 ai = _mm512_set1_ps(a[i]), lowest = _mm512_set1_ps(least);
        for (; j + 16 <= i + 1; j += 16) {
          const __m512 log_decay = _mm512_sub_ps(ai, _mm512_loadu_ps(a + j));
          const __m512 decay = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(log_decay, lowest, _CMP_GE_OQ),
                                                   engine_cpu::exp512(log_decay));
          const __m512 weighted = _mm512_mul_ps(_mm512_loadu_ps(mi + j), decay);
          _mm512_storeu_ps(oi + j, _mm512_mul_ps(weighted, _mm512_loadu_ps(d + j)));
        }
#endif
        for (; j <= i; ++j) {
          const float log_decay = a[i] - a[j];
          oi[j] = log_decay < least ? 0.f : mi[j] * std::exp(log_decay) * d[j];
        }
        for (; j < length; ++j) oi[j] = 0.f;
      }
    }
  });
}

// states [B, c, H, P, N] (in place): each chunk's own state becomes the state entering it,
// S_0 = initial, S_{k+1} = decays[k] S_k + own_k; final [B, H, P, N] = S after the last chunk.
// decays [B, c, H]; all float32.
void mamba2_pass_states(torch::Tensor states, torch::Tensor decays, torch::Tensor initial, torch::Tensor final_state) {
  TORCH_CHECK(states.is_contiguous() && decays.is_contiguous() && initial.is_contiguous() &&
                  final_state.is_contiguous(),
              "mamba2_pass_states: contiguous tensors");
  TORCH_CHECK(states.scalar_type() == at::kFloat && decays.scalar_type() == at::kFloat &&
                  initial.scalar_type() == at::kFloat && final_state.scalar_type() == at::kFloat,
              "mamba2_pass_states: float32 tensors");
  const int64_t seqs = states.size(0), chunks = states.size(1), heads = states.size(2);
  const int64_t numel = states.size(3) * states.size(4);
  const float* dp = decays.data_ptr<float>();
  const float* ip = initial.data_ptr<float>();
  float* fp = final_state.data_ptr<float>();
  float* sp = states.data_ptr<float>();
  at::parallel_for(0, seqs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads;
      float* carried = fp + task * numel;
      std::memcpy(carried, ip + task * numel, numel * sizeof(float));
      for (int64_t k = 0; k < chunks; ++k) {
        float* own = sp + ((s * chunks + k) * heads + h) * numel;
        const float decay = dp[(s * chunks + k) * heads + h];
        for (int64_t e = 0; e < numel; ++e) {
          const float chunk_state = own[e];
          own[e] = carried[e];
          carried[e] = decay * carried[e] + chunk_state;
        }
      }
    }
  });
}

// out [T, H, P], token t = row r of sequence s (chunk c = r / l, row i = r % l):
// y[s, c, h, i] + exp(cumulative[s, c, h, i]) entering[s, c, g, i, h % (H / G)] + D[h] x[s, c, h, i],
// the exp 0 where cumulative < log_floor. y and x [B, c, H, l, P], entering [B, c, G, l, H / G,
// P], cumulative [B, c, H, l], D [H]: float32; token_seq and token_row [T] int64.
void mamba2_gather_outputs(torch::Tensor out, torch::Tensor y, torch::Tensor entering, torch::Tensor x,
                           torch::Tensor cumulative, torch::Tensor D, torch::Tensor token_seq,
                           torch::Tensor token_row, double log_floor) {
  TORCH_CHECK(out.is_contiguous() && y.is_contiguous() && entering.is_contiguous() && x.is_contiguous() &&
                  cumulative.is_contiguous() && D.is_contiguous() && token_seq.is_contiguous() &&
                  token_row.is_contiguous(),
              "mamba2_gather_outputs: contiguous tensors");
  TORCH_CHECK(out.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                  entering.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  cumulative.scalar_type() == at::kFloat && D.scalar_type() == at::kFloat,
              "mamba2_gather_outputs: float32 tensors");
  const int64_t tokens = out.size(0), chunks = y.size(1), heads = y.size(2), length = y.size(3),
                head_size = y.size(4), groups = entering.size(2), per_group = heads / groups;
  const int64_t* seq = token_seq.data_ptr<int64_t>();
  const int64_t* row = token_row.data_ptr<int64_t>();
  const float* cum = cumulative.data_ptr<float>();
  const float* dp = D.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* ep = entering.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = seq[t], c = row[t] / length, i = row[t] % length, base = s * chunks + c;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t head_row = (base * heads + h) * length + i;
        const float scale = cum[head_row] < log_floor ? 0.f : std::exp(cum[head_row]), skip = dp[h];
        const float* yr = yp + head_row * head_size;
        const float* xr = xp + head_row * head_size;
        const float* er = ep + (((base * groups + h / per_group) * length + i) * per_group + h % per_group) * head_size;
        float* o = op + (t * heads + h) * head_size;
        for (int64_t p = 0; p < head_size; ++p) o[p] = yr[p] + scale * er[p] + skip * xr[p];
      }
    }
  });
}

// One token a sequence, in place on the slots: sequence b (slot slots[b], from zeros where
// fresh[b]) convolves [its kept inputs; xbc[b]] (+ bias), SiLU, rounded to xbc's dtype, keeps its
// last K - 1 inputs, then per head S = exp(delta A) S + delta x Bᵀ and out[b] = S C + D x.
// xbc [B, C]; state [slots, (K - 1) C + H P N] float32; weight [K, C] float32 (transposed);
// bias [C] float32 or empty; delta [B, H], A and D [H] float32; out [B, H, P] float32.
void mamba2_decode(torch::Tensor out, torch::Tensor xbc, torch::Tensor state, torch::Tensor slots,
                   torch::Tensor fresh, torch::Tensor weight, torch::Tensor bias, torch::Tensor delta,
                   torch::Tensor A, torch::Tensor D, int64_t groups, int64_t state_size) {
  TORCH_CHECK(out.is_contiguous() && xbc.is_contiguous() && state.is_contiguous() && slots.is_contiguous() &&
                  fresh.is_contiguous() && weight.is_contiguous() && bias.is_contiguous() && delta.is_contiguous() &&
                  A.is_contiguous() && D.is_contiguous(),
              "mamba2_decode: contiguous tensors");
  TORCH_CHECK(out.scalar_type() == at::kFloat && state.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && (bias.numel() == 0 || bias.scalar_type() == at::kFloat) &&
                  delta.scalar_type() == at::kFloat && A.scalar_type() == at::kFloat && D.scalar_type() == at::kFloat &&
                  slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool,
              "mamba2_decode: float32 out, state, weight, bias, delta, A and D; int64 slots; bool fresh");
  const int64_t seqs = out.size(0), heads = out.size(1), head_size = out.size(2);
  const int64_t channels = xbc.size(1), kernel = weight.size(0), width = kernel - 1;
  const int64_t x_channels = heads * head_size, bc_channels = groups * state_size, per_group = heads / groups;
  const int64_t conv_numel = width * channels, ssm_numel = head_size * state_size;
  TORCH_CHECK(channels == x_channels + 2 * bc_channels && state.size(1) == conv_numel + heads * ssm_numel,
              "mamba2_decode: channel counts and state size");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float* dp = delta.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* skip = D.data_ptr<float>();
  float* st = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_numel = state.size(1);
  std::vector<float> activated(seqs * channels);
  DISPATCH_F32_BF16(xbc.scalar_type(), "mamba2_decode", [&] {
    const scalar_t* in = xbc.data_ptr<scalar_t>();
    // the convolution of each sequence, its kept inputs moved on by one
    at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> window(kernel * channels);
      for (int64_t b = begin; b < end; ++b) {
        float* kept = st + sp[b] * row_numel;
        if (fp[b]) {
          std::memset(window.data(), 0, conv_numel * sizeof(float));
        } else {
          std::memcpy(window.data(), kept, conv_numel * sizeof(float));
        }
        for (int64_t ch = 0; ch < channels; ++ch) window[conv_numel + ch] = load(in + b * channels + ch);
        std::memcpy(kept, window.data() + channels, conv_numel * sizeof(float));
        float* act = activated.data() + b * channels;
        for (int64_t ch = 0; ch < channels; ++ch) {
          float sum = 0.f;
          for (int64_t k = 0; k < kernel; ++k) sum += window[k * channels + ch] * wp[k * channels + ch];
          if (bp) sum += bp[ch];
          act[ch] = rounded<scalar_t>(silu(sum));
        }
      }
    });
  });
  // one recurrence step of each (sequence, head)
  at::parallel_for(0, seqs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads, g = h / per_group;
      float* s = st + sp[b] * row_numel + conv_numel + h * ssm_numel;
      const float* act = activated.data() + b * channels;
      const float* x = act + h * head_size;
      const float* bb = act + x_channels + g * state_size;
      const float* cc = bb + bc_channels;
      const float dt = dp[task], decay = fp[b] ? 0.f : std::exp(dt * ap[h]);
      float* o = op + task * head_size;
      for (int64_t p = 0; p < head_size; ++p) {
        float* row = s + p * state_size;
        const float input = dt * x[p];
        float y = 0.f;
        for (int64_t n = 0; n < state_size; ++n) {
          // a fresh sequence's slot holds garbage: decay 0 alone would keep a NaN in it
          const float kept = fp[b] ? 0.f : row[n];
          row[n] = decay * kept + input * bb[n];
          y += row[n] * cc[n];
        }
        o[p] = y + skip[h] * x[p];
      }
    }
  });
}
