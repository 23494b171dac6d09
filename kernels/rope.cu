// Per-head q/k RMSNorm (Qwen3, optional) and rotary embeddings, rotate-half (NeoX)
// style as the CPU model and Hugging Face Llama use, in place on the f32 q|k|v rows.
// Grid (rows, n_heads + n_kv_heads), one warp per head. The angle is the f32 product
// position * inv_freq, then cos/sin in double rounded to f32: the same numbers as the
// CPU tables.

extern "C" __global__ void qk_norm_rope(float* __restrict__ qkv, int stride, int n_heads,
                                        int head_dim, const float* __restrict__ q_norm,
                                        const float* __restrict__ k_norm, float eps,
                                        const int* __restrict__ pos,
                                        const float* __restrict__ inv_freq) {
    const int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    // k heads follow the q heads in the fused row, so head h starts at h * head_dim.
    float* v = qkv + (size_t)r * stride + (size_t)h * head_dim;
    const float* nw = h < n_heads ? q_norm : k_norm;
    if (nw != 0) {
        float s = 0.0f;
        for (int i = lane; i < head_dim; i += 32) {
            s += v[i] * v[i];
        }
        s = warp_sum(s);
        const float inv = 1.0f / sqrtf(s / (float)head_dim + eps);
        for (int i = lane; i < head_dim; i += 32) {
            v[i] = nw[i] * (v[i] * inv);
        }
        __syncwarp();
    }
    const int half = head_dim / 2;
    const float p = (float)pos[r];
    for (int i = lane; i < half; i += 32) {
        const double a = (double)(p * inv_freq[i]);
        const float c = (float)cos(a), s = (float)sin(a);
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
    }
}
