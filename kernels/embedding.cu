// Token embedding gather (bf16 table to the f32 residual stream) and bias addition.

extern "C" __global__ void embed_tokens(const bf16_t* __restrict__ table,
                                        const int* __restrict__ tokens, float* __restrict__ x,
                                        int hidden) {
    const int r = blockIdx.x;
    const bf16_t* src = table + (size_t)tokens[r] * hidden;
    float* dst = x + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = bf16_to_f32(src[i]);
    }
}

// y[r][c] += bias[c] for `rows` rows of width `cols`.
extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ bias,
                                    int rows, int cols) {
    const size_t n = (size_t)rows * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        y[i] += bias[i % cols];
    }
}
