// Shared by every kernel file: bf16 storage type and its conversions, warp and block
// reductions. Written without CUDA toolkit headers so NVRTC compiles the kernels from
// its library alone (the backend prepends this file to the others).

typedef unsigned short bf16_t;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

// Round to nearest even, as torch and the half crate do; NaN stays NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Eight bf16 values from one 16-byte load.
__device__ __forceinline__ void unpack8(uint4 raw, float* out) {
    unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    }
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? scratch[lane] : NEG_INF;
    return warp_max(v);
}
