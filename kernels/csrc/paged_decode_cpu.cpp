// Paged-attention decode for the CPU: one query token per sequence, keys and values read in place
// from a heads-major block pool ([kv_heads, blocks, block_size, head_dim]).
//
// Why native code: in torch the decode step gathers every sequence's blocks into a padded copy, then
// runs bmm with only `group` query rows per kv head; the gather and the tiny matmuls cost more than
// the rest of the layer (bench/engine_bench.py profile). Here each (sequence, kv head) task streams its
// blocks once, the `group` query heads that share the kv head reuse every loaded key and value row,
// and nothing is padded or copied.
//
// Plain C ABI (loaded with ctypes, see kernels/cpu_native.py) so it builds in about a second with no
// torch headers. OpenMP shares torch's runtime: the process already holds libgomp.so.1.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "bfloat16.h"
#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define TOKENMILL_AVX512 1
#else
#define TOKENMILL_AVX512 0
#endif

namespace {

using tokenmill::store;
using tokenmill::to_float;

#if TOKENMILL_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// {sum(a), sum(b), sum(c), sum(d)}: four horizontal sums sharing their shuffles, where four
// _mm512_reduce_add_ps would each pay for a full tree.
inline __m128 reduce_add4(__m512 a, __m512 b, __m512 c, __m512 d) {
    // Per 128-bit lane: {a0+a2, b0+b2, a1+a3, b1+b3}, and the same for c and d.
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // Per 128-bit lane: {a, b, c, d} summed over the lane's four elements.
    const __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

#endif

// The passes over a sequence's keys and values ask for the rows of the block two ahead as they read the
// same rows of this one. The blocks lie anywhere in the pool and are only block_size * head_dim elements
// (2-4 KB) long, too short for the hardware prefetchers to ramp up on: without this every block began with a
// run of cache misses and the passes waited on latency, not bandwidth (perf: most samples on the loads).
// Row by row rather than a whole block at once, which filled the miss buffers and stalled on them. At 64
// sequences x 300 tokens (bfloat16, 30 layers, 2-core EPYC Zen 4) a step's attention took 0.77-0.80 the time;
// the generic loops (AVX2) do the same: 0.76-0.80 at 4-64 sequences x 300-400 tokens (EPYC Zen 3).
// Running on from the keys into the values and from the values into the next task's keys, instead of stopping
// two blocks before each pass's end, took 0.89x the time at 64 x 300 and 0.93x at 4 x 400 (KV pool on huge
// pages, 2-core EPYC Zen 5, same bits).
// (Widening bfloat16 by shift and mask, 32 at a time, was 10% faster on a cached layer but sums the dot
// products in another order: enough to flip 5 of 1,024 greedy tokens in bench/quality_bench.py. Left out.)
template <typename C>
inline void prefetch(const C* first, int64_t elements) {
    const char* bytes = reinterpret_cast<const char*>(first);
    for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(C)); offset += 64)
        __builtin_prefetch(bytes + offset, 0, 3);
}

#if TOKENMILL_AVX512
inline __m512 dot64(const __m512* q, __m512 k0, __m512 k1, __m512 k2, __m512 k3) {
    __m512 dot = _mm512_mul_ps(q[0], k0);
    dot = _mm512_fmadd_ps(q[1], k1, dot);
    dot = _mm512_fmadd_ps(q[2], k2, dot);
    return _mm512_fmadd_ps(q[3], k3, dot);
}
#endif

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 256;

// HeadDim > 0 and Group > 0 fix head_dim and the query heads per kv head at compile time, so the
// common shapes get unrolled loops with the queries and accumulators in registers; 0 reads them at
// run time.
// T: the query's and output's element type; C: the caches' (bfloat16 caches under float32 activations halve the
// bytes a step reads; every value is widened to float32 as it is loaded either way).
template <typename T, typename C, int64_t HeadDim, int64_t Group>
void decode(const T* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
            const int32_t* context_lens, T* out, int64_t seqs, int64_t heads, int64_t kv_heads,
            int64_t runtime_head_dim, int64_t block_size, int64_t pool_blocks, int64_t table_stride,
            int64_t query_stride, float scale, int threads) {
    const int64_t head_dim = HeadDim > 0 ? HeadDim : runtime_head_dim;
    const int64_t group = Group > 0 ? Group : heads / kv_heads;
    const int64_t head_stride = pool_blocks * block_size * head_dim;  // one kv head's whole pool
    const int64_t block_stride = block_size * head_dim;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < seqs * kv_heads; ++task) {
        const int64_t seq = task / kv_heads;
        const int64_t kv_head = task % kv_heads;
        const int64_t length = context_lens[seq];
        const int32_t* table = block_tables + seq * table_stride;
        const C* keys = key_cache + kv_head * head_stride;
        const C* values = value_cache + kv_head * head_stride;
        // The block two after the one at `first` in `cache`, to prefetch, in the thread's stream of blocks: this
        // task's keys, then its values, then the first keys of the task the thread likely takes next (tasks are
        // handed out in order, so about `threads` further on; a wrong guess still warms the shared L3).
        const int64_t task_blocks = (length + block_size - 1) / block_size;
        const auto block_two_ahead = [&](const C* cache, int64_t first) -> const C* {
            const int64_t ahead = first / block_size + 2;
            if (ahead < task_blocks) return cache + table[ahead] * block_stride;
            const int64_t beyond = ahead - task_blocks;  // 0 or 1
            if (cache == keys) return beyond < task_blocks ? values + table[beyond] * block_stride : nullptr;
            const int64_t next = task + omp_get_num_threads();
            if (next >= seqs * kv_heads || beyond * block_size >= context_lens[next / kv_heads]) return nullptr;
            return key_cache + (next % kv_heads) * head_stride +
                   block_tables[next / kv_heads * table_stride + beyond] * block_stride;
        };

        float q[kMaxGroup][kMaxHeadDim];
        for (int64_t g = 0; g < group; ++g) {
            const T* row = query + seq * query_stride + (kv_head * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) q[g][d] = to_float(row[d]) * scale;
        }

        // Two passes over the keys' scores (kept in a small buffer) instead of an online softmax:
        // at these lengths the buffer stays in L1/L2 and the rescaling work disappears.
        std::vector<float> scores(static_cast<size_t>(group * length));
#if TOKENMILL_AVX512
        if constexpr (HeadDim == 64 && Group > 0) {
            // Each key row is loaded and widened once, then dotted with every query of the group.
            __m512 q_vectors[Group][4];
            for (int64_t g = 0; g < Group; ++g)
                for (int i = 0; i < 4; ++i) q_vectors[g][i] = _mm512_loadu_ps(&q[g][16 * i]);
            for (int64_t first = 0; first < length; first += block_size) {
                const C* block = keys + table[first / block_size] * block_stride;
                const int64_t rows = length - first < block_size ? length - first : block_size;
                const C* ahead = block_two_ahead(keys, first);
                int64_t j = 0;
                for (; j + 4 <= rows; j += 4) {  // four keys at a time, their four sums reduced together
                    const C* key = block + j * 64;
                    if (ahead != nullptr) prefetch(ahead + j * 64, 4 * 64);
                    __m512 k[4][4];
                    for (int r = 0; r < 4; ++r)
                        for (int i = 0; i < 4; ++i) k[r][i] = load16(key + r * 64 + 16 * i);
                    for (int64_t g = 0; g < Group; ++g) {
                        const __m128 four = reduce_add4(dot64(q_vectors[g], k[0][0], k[0][1], k[0][2], k[0][3]),
                                                        dot64(q_vectors[g], k[1][0], k[1][1], k[1][2], k[1][3]),
                                                        dot64(q_vectors[g], k[2][0], k[2][1], k[2][2], k[2][3]),
                                                        dot64(q_vectors[g], k[3][0], k[3][1], k[3][2], k[3][3]));
                        _mm_storeu_ps(&scores[g * length + first + j], four);
                    }
                }
                for (; j < rows; ++j) {
                    const C* key = block + j * 64;
                    const __m512 k0 = load16(key), k1 = load16(key + 16), k2 = load16(key + 32), k3 = load16(key + 48);
                    for (int64_t g = 0; g < Group; ++g)
                        scores[g * length + first + j] = _mm512_reduce_add_ps(dot64(q_vectors[g], k0, k1, k2, k3));
                }
            }
        } else
#endif
        {
            float key_row[kMaxHeadDim];
            // Walk block by block: no division per key, and each block's rows are contiguous.
            for (int64_t first = 0; first < length; first += block_size) {
                const C* block = keys + table[first / block_size] * block_stride;
                const int64_t rows = length - first < block_size ? length - first : block_size;
                const C* ahead = block_two_ahead(keys, first);
                for (int64_t j = 0; j < rows; ++j) {
                    if (ahead != nullptr) prefetch(ahead + j * head_dim, head_dim);
                    const C* key = block + j * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) key_row[d] = to_float(key[d]);
                    for (int64_t g = 0; g < group; ++g) {
                        float dot = 0.f;
    #pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; ++d) dot += q[g][d] * key_row[d];
                        scores[g * length + first + j] = dot;
                    }
                }
            }
        }
        float row_max[kMaxGroup];
        for (int64_t g = 0; g < group; ++g) {
            float best = -INFINITY;
            const float* s = scores.data() + g * length;
#pragma omp simd reduction(max : best)
            for (int64_t pos = 0; pos < length; ++pos) best = s[pos] > best ? s[pos] : best;
            row_max[g] = best;
        }
        float row_sum[kMaxGroup];
        for (int64_t g = 0; g < group; ++g) {
            float sum = 0.f;
            float* s = scores.data() + g * length;
#pragma omp simd reduction(+ : sum)
            for (int64_t pos = 0; pos < length; ++pos) {
                s[pos] = tokenmill::fast_exp(s[pos] - row_max[g]);
                sum += s[pos];
            }
            row_sum[g] = sum;
        }

        float acc[kMaxGroup][kMaxHeadDim];
        for (int64_t g = 0; g < group; ++g)
            for (int64_t d = 0; d < head_dim; ++d) acc[g][d] = 0.f;
#if TOKENMILL_AVX512
        if constexpr (HeadDim == 64 && Group > 0) {
            __m512 sums[Group][4];
            for (int64_t g = 0; g < Group; ++g)
                for (int i = 0; i < 4; ++i) sums[g][i] = _mm512_setzero_ps();
            for (int64_t first = 0; first < length; first += block_size) {
                const C* block = values + table[first / block_size] * block_stride;
                const int64_t rows = length - first < block_size ? length - first : block_size;
                const C* ahead = block_two_ahead(values, first);
                for (int64_t j = 0; j < rows; ++j) {
                    if (ahead != nullptr) prefetch(ahead + j * 64, 64);
                    const C* value = block + j * 64;
                    const __m512 v[4] = {load16(value), load16(value + 16), load16(value + 32), load16(value + 48)};
                    for (int64_t g = 0; g < Group; ++g) {
                        const __m512 weight = _mm512_set1_ps(scores[g * length + first + j]);
                        for (int i = 0; i < 4; ++i) sums[g][i] = _mm512_fmadd_ps(weight, v[i], sums[g][i]);
                    }
                }
            }
            for (int64_t g = 0; g < Group; ++g)
                for (int i = 0; i < 4; ++i) _mm512_storeu_ps(&acc[g][16 * i], sums[g][i]);
        } else
#endif
        {
            float value_row[kMaxHeadDim];
            for (int64_t first = 0; first < length; first += block_size) {
                const C* block = values + table[first / block_size] * block_stride;
                const int64_t rows = length - first < block_size ? length - first : block_size;
                const C* ahead = block_two_ahead(values, first);
                for (int64_t j = 0; j < rows; ++j) {
                    if (ahead != nullptr) prefetch(ahead + j * head_dim, head_dim);
                    const C* value = block + j * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) value_row[d] = to_float(value[d]);
                    for (int64_t g = 0; g < group; ++g) {
                        const float p = scores[g * length + first + j];
                        for (int64_t d = 0; d < head_dim; ++d) acc[g][d] += p * value_row[d];
                    }
                }
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            T* row = out + (seq * heads + kv_head * group + g) * head_dim;
            const float inv = 1.f / row_sum[g];
            for (int64_t d = 0; d < head_dim; ++d) store(acc[g][d] * inv, row + d);
        }
    }
}

template <typename T, typename C>
void decode_any(const T* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
                const int32_t* context_lens, T* out, int64_t seqs, int64_t heads, int64_t kv_heads,
                int64_t head_dim, int64_t block_size, int64_t pool_blocks, int64_t table_stride,
                int64_t query_stride, float scale, int threads) {
    const int64_t group = heads / kv_heads;
    auto run = [&](auto fixed_head_dim, auto fixed_group) {
        decode<T, C, decltype(fixed_head_dim)::value, decltype(fixed_group)::value>(
            query, key_cache, value_cache, block_tables, context_lens, out, seqs, heads, kv_heads, head_dim,
            block_size, pool_blocks, table_stride, query_stride, scale, threads);
    };
    auto with_group = [&](auto fixed_head_dim) {
        switch (group) {
            case 1: return run(fixed_head_dim, std::integral_constant<int64_t, 1>{});
            case 2: return run(fixed_head_dim, std::integral_constant<int64_t, 2>{});
            case 3: return run(fixed_head_dim, std::integral_constant<int64_t, 3>{});
            case 4: return run(fixed_head_dim, std::integral_constant<int64_t, 4>{});
            case 8: return run(fixed_head_dim, std::integral_constant<int64_t, 8>{});
            default: return run(fixed_head_dim, std::integral_constant<int64_t, 0>{});
        }
    };
    if (head_dim == 64) {
        with_group(std::integral_constant<int64_t, 64>{});
    } else if (head_dim == 128) {
        with_group(std::integral_constant<int64_t, 128>{});
    } else {
        run(std::integral_constant<int64_t, 0>{}, std::integral_constant<int64_t, 0>{});
    }
}

}  // namespace

// The caches travel as void pointers: kernels/decode_stack.py hands this function to the decode stack, which
// calls it for every cache element type through one function pointer type.
#define TOKENMILL_EXPORT(SUFFIX, T, C)                                                                       \
    void tokenmill_paged_decode_##SUFFIX(const T* query, const void* key_cache, const void* value_cache,     \
                                         const int32_t* block_tables, const int32_t* context_lens, T* out,   \
                                         int64_t seqs, int64_t heads, int64_t kv_heads, int64_t head_dim,    \
                                         int64_t block_size, int64_t pool_blocks, int64_t table_stride,      \
                                         int64_t query_stride, float scale, int threads) {                   \
        decode_any(query, static_cast<const C*>(key_cache), static_cast<const C*>(value_cache), block_tables, \
                   context_lens, out, seqs, heads, kv_heads, head_dim, block_size, pool_blocks, table_stride,  \
                   query_stride, scale, threads);                                                             \
    }

extern "C" {
TOKENMILL_EXPORT(f32, float, float)
TOKENMILL_EXPORT(bf16, uint16_t, uint16_t)
TOKENMILL_EXPORT(f32_bf16kv, float, uint16_t)
}
