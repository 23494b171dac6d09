// SwiGLU activation: rows [gate | up] (f32, width 2 * inter) to silu(gate) * up (bf16,
// width inter), the input of the down projection.

extern "C" __global__ void silu_mul(const float* __restrict__ gate_up, bf16_t* __restrict__ out,
                                    int rows, int inter) {
    const size_t n = (size_t)rows * inter;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / inter, c = i % inter;
        const float g = gate_up[r * 2 * inter + c];
        const float u = gate_up[r * 2 * inter + inter + c];
        out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}
