// Block copies for copy-on-write forks. The cache is one allocation of `planes` planes
// (layer-major, K then V), each [num_blocks][block_elems] bf16. pairs[2i] is copied onto
// pairs[2i + 1] in every plane. Grid (num_pairs, planes).

extern "C" __global__ void copy_blocks(bf16_t* __restrict__ cache, const int* __restrict__ pairs,
                                       long long plane_elems, int block_elems) {
    const int src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
    bf16_t* plane = cache + (size_t)blockIdx.y * (size_t)plane_elems;
    const bf16_t* s = plane + (size_t)src * block_elems;
    bf16_t* d = plane + (size_t)dst * block_elems;
    if ((block_elems & 7) == 0) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        for (int i = threadIdx.x; i < block_elems / 8; i += blockDim.x) {
            d4[i] = s4[i];
        }
    } else {
        for (int i = threadIdx.x; i < block_elems; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}
