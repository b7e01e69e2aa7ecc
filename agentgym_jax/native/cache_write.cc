// A prefill piece's KV-cache write, for XLA's CPU backend (an XLA FFI custom call).
//
// Row b's S new entries go to slots starts[b] .. starts[b] + S - 1 of keys [B, K, H, T] and values [B, K, T, H]
// (fp32, or bf16 held as uint16 bits: the layouts of agentgym_jax.attention), updated in place (XLA aliases them to
// the outputs); slots outside [0, T) are dropped. XLA lowered the same write (a scatter of [B, S] slots) to a loop
// that computed every element's index, ~1.25 ms a layer for the keys alone in a batch-32 prefill of 200-token
// prompts (their slots are the minor axis). Here each (row, kv head) copies its values' rows whole and transposes
// its keys [S, H] -> [H, S] through L1: that prefill 1.82 -> 1.60 s, batch 8 0.585 -> 0.52 s. Pure-JAX
// reference: agentgym_jax.attention.write_slots (tests/test_cache_write.py).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Item = row * kv_heads + head. new_keys, new_values: [B, S, K, H].
template <typename Raw>
void WriteItems(Raw* keys, Raw* values, const Raw* new_keys, const Raw* new_values, const int32_t* starts,
                int64_t kv_heads, int64_t head_dim, int64_t slots, int64_t pieces, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t row = item / kv_heads, head = item % kv_heads, start = starts[row];
    const int64_t first = std::clamp<int64_t>(-start, 0, pieces), last = std::clamp<int64_t>(slots - start, 0, pieces);
    if (first >= last) continue;
    const int64_t entry_stride = kv_heads * head_dim;  // from one new entry of this head to the next
    const Raw* new_k = new_keys + row * pieces * entry_stride + head * head_dim;
    const Raw* new_v = new_values + row * pieces * entry_stride + head * head_dim;
    Raw* k = keys + item * head_dim * slots + start;
    Raw* v = values + (item * slots + start) * head_dim;
    for (int64_t s = first; s < last; ++s)
      std::memcpy(v + s * head_dim, new_v + s * entry_stride, head_dim * sizeof(Raw));
    for (int64_t h = 0; h < head_dim; ++h)  // each key row's slots are contiguous; the new entries stay in L1
      for (int64_t s = first; s < last; ++s) k[h * slots + s] = new_k[s * entry_stride + h];
  }
}

// keys [B, K, H, T], values [B, K, T, H], new_keys and new_values [B, S, K, H] (all fp32 or all u16), starts [B].
ffi::Error CacheWrite(ffi::ThreadPool pool, ffi::AnyBuffer keys, ffi::AnyBuffer values, ffi::AnyBuffer new_keys,
                      ffi::AnyBuffer new_values, ffi::Buffer<ffi::S32> starts, ffi::Result<ffi::AnyBuffer> keys_out,
                      ffi::Result<ffi::AnyBuffer> values_out) {
  const auto kd = keys.dimensions(), vd = values.dimensions(), nd = new_keys.dimensions();
  if (kd.size() != 4 || vd.size() != 4 || nd.size() != 4)
    return ffi::Error::InvalidArgument("cache_write: keys, values and new entries must have rank 4");
  const int64_t rows = kd[0], kv_heads = kd[1], head_dim = kd[2], slots = kd[3], pieces = nd[1];
  if (vd[0] != rows || vd[1] != kv_heads || vd[2] != slots || vd[3] != head_dim || nd[0] != rows ||
      nd[2] != kv_heads || nd[3] != head_dim || new_values.element_count() != new_keys.element_count() ||
      starts.element_count() != rows)
    return ffi::Error::InvalidArgument("cache_write: keys [B,K,H,T], values [B,K,T,H], new [B,S,K,H], starts [B]");
  const auto type = keys.element_type();
  if (values.element_type() != type || new_keys.element_type() != type || new_values.element_type() != type ||
      (type != ffi::F32 && type != ffi::U16))
    return ffi::Error::InvalidArgument("cache_write: caches and new entries must all be f32 or all u16 (bf16 bits)");
  if (keys_out->untyped_data() != keys.untyped_data())  // XLA aliases them; a copy keeps this correct otherwise
    std::memcpy(keys_out->untyped_data(), keys.untyped_data(), keys.size_bytes());
  if (values_out->untyped_data() != values.untyped_data())
    std::memcpy(values_out->untyped_data(), values.untyped_data(), values.size_bytes());
  agentgym::Parallel(pool, rows * kv_heads, [&](int64_t begin, int64_t end) {
    if (type == ffi::U16)
      WriteItems(static_cast<uint16_t*>(keys_out->untyped_data()), static_cast<uint16_t*>(values_out->untyped_data()),
                 static_cast<const uint16_t*>(new_keys.untyped_data()),
                 static_cast<const uint16_t*>(new_values.untyped_data()), starts.typed_data(), kv_heads, head_dim,
                 slots, pieces, begin, end);
    else
      WriteItems(static_cast<float*>(keys_out->untyped_data()), static_cast<float*>(values_out->untyped_data()),
                 static_cast<const float*>(new_keys.untyped_data()),
                 static_cast<const float*>(new_values.untyped_data()), starts.typed_data(), kv_heads, head_dim, slots,
                 pieces, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentgymCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
