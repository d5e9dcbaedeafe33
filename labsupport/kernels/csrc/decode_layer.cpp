// One decoder layer in one call (why, and its Python side: kernels/cpu_decode_layers.py). Compiled in one
// translation unit after model_ops.cpp, products.cpp and paged_decode.cpp, whose kernels it calls.
#include "vectors.h"

// One decoder layer for B decode tokens (B <= 3): the Python layer's calls, in its order, from C++.
// x [B, hidden] -> x + attention + MLP; writes the B new tokens' K/V into their slots of the [Hkv, slots, D] pools.
torch::Tensor decode_layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b,
                           torch::Tensor o_w, torch::Tensor ln2, torch::Tensor gate_up_w, torch::Tensor down_w,
                           double eps, int64_t heads, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool,
                           torch::Tensor v_pool, torch::Tensor slots, torch::Tensor block_tables,
                           torch::Tensor context_lens, int64_t block_size) {
  const int64_t B = x.size(0), Hkv = k_pool.size(0), S = k_pool.size(1), D = k_pool.size(2);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && slots.numel() == B
              && slots.scalar_type() == torch::kLong, "decode_layer: unexpected inputs");
  auto qkv = thin_product(rms_norm(x, ln1, eps), qkv_w, qkv_b);
  auto q = qkv.narrow(1, 0, heads * D).view({B, heads, D});
  auto k = qkv.narrow(1, heads * D, Hkv * D).view({B, Hkv, D});
  auto v = qkv.narrow(1, (heads + Hkv) * D, Hkv * D).view({B, Hkv, D});
  auto rotated = rope_qk(q, k, cos, sin);
  const int64_t *slot = slots.data_ptr<int64_t>();
  const float *kr = rotated[1].data_ptr<float>();
  float *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g) {
      std::memcpy(kp + (g * S + slot[b]) * D, kr + (b * Hkv + g) * D, D * sizeof(float));
      std::memcpy(vp + (g * S + slot[b]) * D, v[b][g].data_ptr<float>(), D * sizeof(float));
    }
  auto out = paged_decode(rotated[0], k_pool, v_pool, block_tables, context_lens, block_size, 1.0 / std::sqrt((double)D));
  x = x + thin_product(out.view({B, heads * D}), o_w, c10::nullopt);
  auto activated = silu_mul(thin_product(rms_norm(x, ln2, eps), gate_up_w, c10::nullopt));
  return x + thin_product(activated, down_w, c10::nullopt);
}
