// Prefill attention: the new tokens of one sequence attend causally to its cached
// prefix and to each other, all read through the block table (the new tokens' K/V are
// written to their slots first).
//
// Grid (tiles, n_heads), PF_ROWS warps per block. A tile is up to PF_ROWS consecutive
// query rows of one sequence; warp w owns row row0 + w. The block stages PF_KEYS keys
// and values at a time in shared memory (f32, K rows padded against bank conflicts);
// lane j scores key j, the warp keeps an online softmax, and each lane accumulates the
// output dimensions d = lane + 32 i.

#define PF_ROWS 8
#define PF_KEYS 32

template <int HD>
__device__ __forceinline__ void prefill_attention_impl(
    bf16_t* __restrict__ out, int out_stride, const float* __restrict__ q, int q_stride,
    const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
    const int* __restrict__ tables, const int* __restrict__ tile_row0,
    const int* __restrict__ tile_rows, const int* __restrict__ table_off,
    const int* __restrict__ row_pos, int n_heads, int n_kv_heads, int block_size, int window,
    float scale) {
    constexpr int DPL = (HD + 31) / 32;
    __shared__ float s_k[PF_KEYS][HD + 1];
    __shared__ float s_v[PF_KEYS][HD];
    __shared__ float s_q[PF_ROWS][HD];

    const int tile = blockIdx.x, h = blockIdx.y;
    const int G = n_heads / n_kv_heads, kvh = h / G;
    const int row0 = tile_row0[tile], nrows = tile_rows[tile];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos0 = row_pos[row0];
    const int* table = tables + table_off[row0];
    const size_t kv_dim = (size_t)n_kv_heads * HD;
    const int k_lo = window > 0 ? max(0, pos0 + 1 - window) : 0;
    const int k_hi = pos0 + nrows;  // exclusive

    for (int i = tid; i < PF_ROWS * HD; i += PF_ROWS * 32) {
        const int r = i / HD, d = i % HD;
        s_q[r][d] = r < nrows ? q[(size_t)(row0 + r) * q_stride + (size_t)h * HD + d] * scale : 0.0f;
    }
    const bool active = warp < nrows;
    const int my_pos = pos0 + warp;
    const int my_lo = window > 0 ? max(0, my_pos + 1 - window) : 0;
    float m = NEG_INF, l = 0.0f;
    float acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        acc[i] = 0.0f;
    }

    for (int kt = k_lo; kt < k_hi; kt += PF_KEYS) {
        __syncthreads();
        for (int i = tid; i < PF_KEYS * HD; i += PF_ROWS * 32) {
            const int j = i / HD, d = i % HD;
            const int p = kt + j;
            float kv = 0.0f, vv = 0.0f;
            if (p < k_hi) {
                const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                const size_t off = slot * kv_dim + (size_t)kvh * HD + d;
                kv = bf16_to_f32(k_cache[off]);
                vv = bf16_to_f32(v_cache[off]);
            }
            s_k[j][d] = kv;
            s_v[j][d] = vv;
        }
        __syncthreads();
        if (!active) {
            continue;
        }
        const int p = kt + lane;
        const bool visible = lane < PF_KEYS && p >= my_lo && p <= my_pos;
        float s = NEG_INF;
        if (visible) {
            s = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HD; d++) {
                s += s_q[warp][d] * s_k[lane][d];
            }
        }
        const float tile_max = warp_max(s);
        if (tile_max == NEG_INF) {
            continue;
        }
        const float new_m = fmaxf(m, tile_max);
        const float corr = m == NEG_INF ? 0.0f : __expf(m - new_m);
        const float e = visible ? __expf(s - new_m) : 0.0f;
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            acc[i] *= corr;
        }
        for (int j = 0; j < PF_KEYS; j++) {
            const float pj = __shfl_sync(FULL_MASK, e, j);
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int d = lane + 32 * i;
                if (d < HD) {
                    acc[i] += pj * s_v[j][d];
                }
            }
        }
        m = new_m;
    }
    if (active) {
        const float inv = 1.0f / l;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            const int d = lane + 32 * i;
            if (d < HD) {
                out[(size_t)(row0 + warp) * out_stride + (size_t)h * HD + d] = f32_to_bf16(acc[i] * inv);
            }
        }
    }
}

#define PREFILL_ATTENTION(HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(PF_ROWS * 32) prefill_attention_hd##HD(          \
        bf16_t* out, int out_stride, const float* q, int q_stride, const bf16_t* k_cache,          \
        const bf16_t* v_cache, const int* tables, const int* tile_row0, const int* tile_rows,      \
        const int* table_off, const int* row_pos, int n_heads, int n_kv_heads, int block_size,     \
        int window, float scale) {                                                                 \
        prefill_attention_impl<HD>(out, out_stride, q, q_stride, k_cache, v_cache, tables,         \
                                   tile_row0, tile_rows, table_off, row_pos, n_heads, n_kv_heads, \
                                   block_size, window, scale);                                     \
    }

PREFILL_ATTENTION(16)
PREFILL_ATTENTION(32)
PREFILL_ATTENTION(64)
PREFILL_ATTENTION(128)
