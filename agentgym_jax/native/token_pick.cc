// A decode step's token pick from fp32 logits [B, V], one row at a time (an XLA FFI custom call for XLA's CPU
// backend): the greedy pick (the first maximum) or an inverse-CDF draw at the row's temperature with its uniform
// number, and the picked token's log-probability at the log-prob temperature.
//
// XLA's CPU backend ran the pure-JAX pick (agentgym_jax.token_draws.draw_tokens without filtering) as a chain of
// single-threaded passes over the logits, writing the whole log-softmax out to read one entry of it: ~2 ms per
// decode step at 8 rows and ~6 ms at 32 on a 2-core Xeon. Here a row takes a few vectorized passes that stay in L2
// (its maximum, its first argmax; the exponential sum; for a draw, its scan and, at another log-prob temperature,
// a second sum), the rows split over the threads. A row holding a NaN gets what the pure-JAX path gives it: the last
// token when greedy, the first when drawn, and a NaN log-prob. The draw
// sums the exponentials in 16-lane blocks in the same order in both passes, so the scan reaches the total exactly;
// a token of zero probability is never drawn. Pure-JAX reference: draw_tokens (tests/test_token_pick.py).

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

#ifndef __AVX512F__
#error "token_pick needs AVX-512F (agentgym_jax.native_kernels only builds it where the CPU has it)"
#endif

namespace ffi = xla::ffi;

namespace {

using agentgym::Exp16;
using agentgym::Lanes;
using agentgym::Load16;

constexpr float kMinTemperature = 1e-6f;  // draw_tokens divides by max(temperature, 1e-6)

// exp(scale * (x - top)) for 16 lanes, 0 for masked-off lanes and for -inf logits.
inline __m512 Weights(const float* x, int64_t left, float scale, float top) {
  const __mmask16 lanes = Lanes(left);
  const __m512 shifted = _mm512_mul_ps(_mm512_sub_ps(Load16(x, lanes), _mm512_set1_ps(top)), _mm512_set1_ps(scale));
  return _mm512_maskz_mov_ps(lanes, Exp16(_mm512_max_ps(shifted, _mm512_set1_ps(-110.0f))));
}

// The row's maximum and the first index holding it; NaN and v - 1 when the row holds a NaN (jnp's max is NaN
// there, and first_argmax finds no index equal to it).
void Maximum(const float* x, int64_t v, float* top, int64_t* first) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 best = lowest;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __m512 values = _mm512_mask_loadu_ps(lowest, Lanes(v - i), x + i);
    nan |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, values);
  }
  *first = v - 1;
  if (nan) {
    *top = NAN;
    return;
  }
  *top = _mm512_reduce_max_ps(best);
  const __m512 target = _mm512_set1_ps(*top);
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 hits = _mm512_mask_cmp_ps_mask(Lanes(v - i), Load16(x + i, Lanes(v - i)), target, _CMP_EQ_OQ);
    if (hits) {
      *first = i + __builtin_ctz(hits);
      return;
    }
  }
}

// sum over the row of exp(scale * (x - top)), block by block (the order Draw's scan adds them in).
float Total(const float* x, int64_t v, float scale, float top) {
  float total = 0.0f;
  for (int64_t i = 0; i < v; i += 16) total += _mm512_reduce_add_ps(Weights(x + i, v - i, scale, top));
  return total;
}

// The first index whose running sum of weights exceeds threshold (< the row's Total): the inverse-CDF draw.
int64_t Draw(const float* x, int64_t v, float scale, float top, float threshold) {
  float running = 0.0f;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __m512 w = Weights(x + i, v - i, scale, top);
    const float block = _mm512_reduce_add_ps(w);
    if (block > 0.0f) last_positive = i + 31 - __builtin_clz(_mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ));
    if (running + block > threshold) {  // in this block: scan its lanes (their sequential sum may fall short)
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, w);
      float inside = running;
      for (int j = 0; j < 16 && i + j < v; ++j) {
        inside += lanes[j];
        if (lanes[j] > 0.0f && inside > threshold) return i + j;
      }
      return last_positive;
    }
    running += block;
  }
  return last_positive;  // rounding put the threshold at the total: the last token that can be drawn
}

ffi::Error TokenPick(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                     ffi::Buffer<ffi::F32> uniform, float logprob_temperature, ffi::ResultBuffer<ffi::S32> tokens,
                     ffi::ResultBuffer<ffi::F32> logprobs) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || ld[1] < 1 || temperature.element_count() != ld[0] || uniform.element_count() != ld[0]
      || tokens->element_count() != ld[0] || logprobs->element_count() != ld[0])
    return ffi::Error::InvalidArgument("token_pick: logits [B, V] and temperature, uniform, tokens, logprobs [B]");
  if (!(logprob_temperature > 0.0f)) return ffi::Error::InvalidArgument("token_pick: logprob_temperature <= 0");
  const int64_t v = ld[1];
  const float* xp = logits.typed_data();
  const float* tp = temperature.typed_data();
  const float* up = uniform.typed_data();
  int32_t* out_tokens = tokens->typed_data();
  float* out_logprobs = logprobs->typed_data();
  agentgym::Parallel(pool, ld[0], [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* x = xp + b * v;
      float top;
      int64_t token;
      Maximum(x, v, &top, &token);
      const float scale = 1.0f / logprob_temperature;
      float total = -1.0f;  // the log-prob's sum, when the draw's is the same
      if (tp[b] != 0.0f) {
        const float draw_scale = 1.0f / std::fmax(tp[b], kMinTemperature);
        const float draw_total = Total(x, v, draw_scale, top);
        if (draw_scale == scale) total = draw_total;
        token = Draw(x, v, draw_scale, top, up[b] * draw_total);
      }
      if (total < 0.0f) total = Total(x, v, scale, top);
      out_tokens[b] = static_cast<int32_t>(token);
      out_logprobs[b] = (x[token] - top) * scale - std::log(total);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymTokenPick, TokenPick,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("logprob_temperature").Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
