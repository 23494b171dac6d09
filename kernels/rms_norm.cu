// RMSNorm of f32 rows into bf16 rows (the input of the next GEMM):
// out = w * (x / sqrt(mean(x^2) + eps)), as LlamaRMSNorm in f32.
// One block per output row; `row_idx` (nullable) picks which input row it reads, so the
// final norm runs only on the rows whose logits are wanted.

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    bf16_t* __restrict__ out, const int* __restrict__ row_idx,
                                    int width, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const int src = row_idx ? row_idx[r] : r;
    const float* xr = x + (size_t)src * width;
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = xr[i];
        s += v * v;
    }
    s = block_sum(s, scratch);
    const float inv = 1.0f / sqrtf(s / (float)width + eps);
    bf16_t* o = out + (size_t)r * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        o[i] = f32_to_bf16(w[i] * (xr[i] * inv));
    }
}
