// Paged decode attention with split-K (flash-decoding) and grouped-query attention.
//
// Grid (decode rows, n_kv_heads, splits); 4 warps per block. Block (row, kvh, split)
// handles the query heads of KV head kvh for one query row, over the row's keys
// [lo + split * DEC_PART, min(pos + 1, lo + (split + 1) * DEC_PART)), read through the
// sequence's block table. Keys and values are read once per KV head and shared by its
// G query heads. Pass 1 puts the partition's scores in shared memory, pass 2 weights
// the values. With one split the block writes the bf16 output row; otherwise it writes
// its normalized partial output, max score and exp-sum, and paged_decode_reduce
// combines the partitions.
//
// Each key/value vector is read as 16-byte chunks: C = HD / 8 lanes per token, so a
// warp covers 32 / C tokens per step; UNROLL steps are loaded before any is used to
// keep enough bytes in flight.

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_PART 512
#define DEC_UNROLL 4

template <int HD, int MAXG>
__device__ __forceinline__ void paged_decode_impl(
    bf16_t* __restrict__ out, int out_stride, float* __restrict__ part_out,
    float* __restrict__ part_max, float* __restrict__ part_sum, const float* __restrict__ q,
    int q_stride, const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
    const int* __restrict__ tables, const int* __restrict__ table_off,
    const int* __restrict__ row_pos, const int* __restrict__ dec_rows, int n_heads,
    int n_kv_heads, int block_size, int window, float scale) {
    constexpr int C = HD / 8;
    constexpr int TPW = 32 / C;
    constexpr int STEP = DEC_WARPS * TPW;
    __shared__ float s_logits[MAXG][DEC_PART];
    __shared__ float s_acc[MAXG][HD];
    __shared__ float s_scratch[32];
    __shared__ float s_max[MAXG];
    __shared__ float s_sum[MAXG];

    const int di = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int row = dec_rows[di];
    const int G = n_heads / n_kv_heads;
    const int pos = row_pos[row];
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int start = lo + split * DEC_PART;
    const int end = min(pos + 1, start + DEC_PART);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / C, chunk = lane % C;
    const size_t kv_dim = (size_t)n_kv_heads * HD;

    if (start >= end) {
        // An empty partition (shorter row in a batch sized for a longer one).
        if (tid < G) {
            const size_t idx = ((size_t)di * n_heads + kvh * G + tid) * splits + split;
            part_max[idx] = NEG_INF;
            part_sum[idx] = 0.0f;
        }
        return;
    }
    const int n = end - start;
    const int* table = tables + table_off[row];

    float qr[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            qr[g][j] = g < G ? q[(size_t)row * q_stride + (size_t)(kvh * G + g) * HD + chunk * 8 + j] * scale
                             : 0.0f;
        }
    }
    for (int i = tid; i < MAXG * HD; i += DEC_THREADS) {
        (&s_acc[0][0])[i] = 0.0f;
    }

    // Pass 1: scores.
    for (int base = warp * TPW; base < n; base += STEP * DEC_UNROLL) {
        uint4 raw[DEC_UNROLL];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int t = base + u * STEP + sub;
            if (t < n) {
                const int p = start + t;
                const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                raw[u] = *(const uint4*)(k_cache + slot * kv_dim + (size_t)kvh * HD + chunk * 8);
            } else {
                raw[u] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int t = base + u * STEP + sub;
            float k[8];
            unpack8(raw[u], k);
            float acc[MAXG];
#pragma unroll
            for (int g = 0; g < MAXG; g++) {
                acc[g] = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    acc[g] += qr[g][j] * k[j];
                }
#pragma unroll
                for (int o = C / 2; o > 0; o >>= 1) {
                    acc[g] += __shfl_xor_sync(FULL_MASK, acc[g], o);
                }
            }
            if (t < n && chunk == 0) {
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    if (g < G) {
                        s_logits[g][t] = acc[g];
                    }
                }
            }
        }
    }
    __syncthreads();

    // Softmax over the partition, per query head.
    for (int g = 0; g < G; g++) {
        float m = NEG_INF;
        for (int t = tid; t < n; t += DEC_THREADS) {
            m = fmaxf(m, s_logits[g][t]);
        }
        m = block_max(m, s_scratch);
        float s = 0.0f;
        for (int t = tid; t < n; t += DEC_THREADS) {
            const float e = __expf(s_logits[g][t] - m);
            s_logits[g][t] = e;
            s += e;
        }
        s = block_sum(s, s_scratch);
        if (tid == 0) {
            s_max[g] = m;
            s_sum[g] = s;
        }
    }
    __syncthreads();

    // Pass 2: weighted values.
    float acc[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            acc[g][j] = 0.0f;
        }
    }
    for (int base = warp * TPW; base < n; base += STEP * DEC_UNROLL) {
        uint4 raw[DEC_UNROLL];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int t = base + u * STEP + sub;
            if (t < n) {
                const int p = start + t;
                const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                raw[u] = *(const uint4*)(v_cache + slot * kv_dim + (size_t)kvh * HD + chunk * 8);
            } else {
                raw[u] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int t = base + u * STEP + sub;
            if (t < n) {
                float v[8];
                unpack8(raw[u], v);
#pragma unroll
                for (int g = 0; g < MAXG; g++) {
                    if (g < G) {
                        const float p = s_logits[g][t];
#pragma unroll
                        for (int j = 0; j < 8; j++) {
                            acc[g][j] += p * v[j];
                        }
                    }
                }
            }
        }
    }
    // Lanes with the same chunk hold different tokens: fold them, then the warps.
#pragma unroll
    for (int g = 0; g < MAXG; g++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int o = C; o < 32; o <<= 1) {
                acc[g][j] += __shfl_xor_sync(FULL_MASK, acc[g][j], o);
            }
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; g++) {
            if (g < G) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    atomicAdd(&s_acc[g][chunk * 8 + j], acc[g][j]);
                }
            }
        }
    }
    __syncthreads();

    for (int i = tid; i < G * HD; i += DEC_THREADS) {
        const int g = i / HD, d = i % HD;
        const float val = s_acc[g][d] / s_sum[g];
        const int h = kvh * G + g;
        if (splits == 1) {
            out[(size_t)row * out_stride + (size_t)h * HD + d] = f32_to_bf16(val);
        } else {
            const size_t idx = ((size_t)di * n_heads + h) * splits + split;
            part_out[idx * HD + d] = val;
            if (d == 0) {
                part_max[idx] = s_max[g];
                part_sum[idx] = s_sum[g];
            }
        }
    }
}

#define PAGED_DECODE(HD, G)                                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) paged_decode_hd##HD##_g##G(        \
        bf16_t* out, int out_stride, float* part_out, float* part_max, float* part_sum,        \
        const float* q, int q_stride, const bf16_t* k_cache, const bf16_t* v_cache,             \
        const int* tables, const int* table_off, const int* row_pos, const int* dec_rows,      \
        int n_heads, int n_kv_heads, int block_size, int window, float scale) {                \
        paged_decode_impl<HD, G>(out, out_stride, part_out, part_max, part_sum, q, q_stride,    \
                                 k_cache, v_cache, tables, table_off, row_pos, dec_rows,        \
                                 n_heads, n_kv_heads, block_size, window, scale);               \
    }

#define PAGED_DECODE_ALL_G(HD) \
    PAGED_DECODE(HD, 1)        \
    PAGED_DECODE(HD, 2)        \
    PAGED_DECODE(HD, 4)        \
    PAGED_DECODE(HD, 8)

PAGED_DECODE_ALL_G(16)
PAGED_DECODE_ALL_G(32)
PAGED_DECODE_ALL_G(64)
PAGED_DECODE_ALL_G(128)

// Combines the split-K partitions of every (decode row, query head): weights each
// partition's normalized output by exp(max_s - max) * sum_s. Grid (decode rows, n_heads).
extern "C" __global__ void paged_decode_reduce(bf16_t* __restrict__ out, int out_stride,
                                               const float* __restrict__ part_out,
                                               const float* __restrict__ part_max,
                                               const float* __restrict__ part_sum,
                                               const int* __restrict__ dec_rows, int n_heads,
                                               int head_dim, int splits) {
    const int di = blockIdx.x, h = blockIdx.y;
    const int row = dec_rows[di];
    const size_t base = ((size_t)di * n_heads + h) * splits;
    float m = NEG_INF;
    for (int s = 0; s < splits; s++) {
        m = fmaxf(m, part_max[base + s]);
    }
    float total = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float sm = part_sum[base + s];
        total += sm > 0.0f ? __expf(part_max[base + s] - m) * sm : 0.0f;
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float sm = part_sum[base + s];
            if (sm > 0.0f) {
                acc += __expf(part_max[base + s] - m) * sm * part_out[(base + s) * head_dim + d];
            }
        }
        out[(size_t)row * out_stride + (size_t)h * head_dim + d] = f32_to_bf16(acc / total);
    }
}
