// Writes the keys and values of the step's new tokens into their KV cache slots (bf16).
// The cache layer is [num_blocks][block_size][n_kv_heads][head_dim], so slot s holds its
// kv_dim values at s * kv_dim. Row r's k and v sit at columns k_off and v_off of the
// f32 q|k|v row. A negative slot skips the row.

extern "C" __global__ void reshape_and_cache(const float* __restrict__ qkv, int stride, int k_off,
                                             int v_off, int kv_dim, const int* __restrict__ slots,
                                             bf16_t* __restrict__ k_cache,
                                             bf16_t* __restrict__ v_cache) {
    const int r = blockIdx.x;
    const int s = slots[r];
    if (s < 0) {
        return;
    }
    const float* row = qkv + (size_t)r * stride;
    bf16_t* kd = k_cache + (size_t)s * kv_dim;
    bf16_t* vd = v_cache + (size_t)s * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kd[i] = f32_to_bf16(row[k_off + i]);
        vd[i] = f32_to_bf16(row[v_off + i]);
    }
}
