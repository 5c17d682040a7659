// The small per-layer CPU ops, each in one pass: RMSNorm with its residual add, rotary embedding,
// SiLU-and-mul, and the KV store into the heads-major pool.
//
// Why native code: in torch each of these is four to ten ops, every one a pass over memory and, under
// load, a wait for the thread pool; at decode sizes (64 rows) those overheads cost more than the
// matmuls (bench/engine_bench.py profile). Each function rounds where the torch reference in kernels/
// rounds (to the activation dtype between ops), and this file is built with -ffp-contract=off, so
// float32 results equal the references' bit for bit except for the order of the RMS sum.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bfloat16.h"
#include "fast_exp.h"

namespace {

using tokenmill::round_to;
using tokenmill::store;
using tokenmill::to_float;

// Below this many elements a thread-pool wake-up costs more than the loop. SiLU does about ten times
// the work per element (an exp and a division), so it splits sooner: 64 rows of 1536 went 61 -> 35 us.
constexpr int64_t kParallelElements = 1 << 17;
constexpr int64_t kParallelSiluElements = 1 << 14;

template <typename T>
void rms_norm(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t rows, int64_t hidden,
              float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
        const T* x_row = x + r * hidden;
        T* out_row = out + r * hidden;
        T* summed_row = new_residual + r * hidden;
        float sum_squares = 0.f;
        // The sums of squares are vector reductions (lanes summed at the end), as in torch's kernel.
        if (residual != nullptr) {
            const T* residual_row = residual + r * hidden;
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < hidden; ++i) {
                const float summed = store(to_float(x_row[i]) + to_float(residual_row[i]), summed_row + i);
                sum_squares += summed * summed;
            }
            x_row = summed_row;
        } else {
#pragma omp simd reduction(+ : sum_squares)
            for (int64_t i = 0; i < hidden; ++i) {
                const float value = to_float(x_row[i]);
                sum_squares += value * value;
            }
        }
        const float inverse = 1.f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
        for (int64_t i = 0; i < hidden; ++i) {
            const float normed = round_to<T>(to_float(x_row[i]) * inverse);
            store(to_float(weight[i]) * normed, out_row + i);
        }
    }
}

// x: [tokens, heads, head_dim] rows `token_stride` apart, rotated in place, neox style (halves).
template <typename T>
void rotate(T* x, int64_t token_stride, const int64_t* positions, const float* cos_sin, int64_t tokens, int64_t heads,
            int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * head_dim >= kParallelElements)
    for (int64_t t = 0; t < tokens; ++t) {
        const float* cos = cos_sin + positions[t] * 2 * head_dim;
        const float* sin = cos + head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            T* row = x + t * token_stride + h * head_dim;
            for (int64_t i = 0; i < half; ++i) {
                const float first = to_float(row[i]), second = to_float(row[i + half]);
                // As the reference: cos and sin rounded to the dtype, each product rounded, then the sum.
                const float a = round_to<T>(first * round_to<T>(cos[i]));
                const float b = round_to<T>(-second * round_to<T>(sin[i]));
                const float c = round_to<T>(second * round_to<T>(cos[i + half]));
                const float d = round_to<T>(first * round_to<T>(sin[i + half]));
                store(a + b, row + i);
                store(c + d, row + i + half);
            }
        }
    }
}

// no-tree-pre: GCC's partial redundancy elimination moved the clamped branch of fast_exp out as its own division,
// g / (1 + e^88), computed for every lane and masked off after: subnormal quotients, a microcode assist per vector,
// and 8192 elements took 53 us instead of 6.6 (2-core Xeon; the same bits).
template <typename T>
__attribute__((optimize("no-tree-pre"))) void silu_and_mul(const T* x, T* out, int64_t rows, int64_t ffn, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * ffn >= kParallelSiluElements)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = x + r * 2 * ffn;
        const T* up = gate + ffn;
        T* out_row = out + r * ffn;
        for (int64_t i = 0; i < ffn; ++i) {
            const float g = to_float(gate[i]);
            const float silu = round_to<T>(g / (1.f + tokenmill::fast_exp(-g)));
            store(silu * to_float(up[i]), out_row + i);
        }
    }
}

// key/value: [tokens, kv_heads, head_dim] rows `*_stride` apart; caches heads-major
// [kv_heads, pool_blocks, block_size, head_dim], of element type C (rounded to it where T is wider).
template <typename T, typename C>
void store_kv(const T* key, const T* value, int64_t key_stride, int64_t value_stride, C* key_cache, C* value_cache,
              const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t pool_blocks,
              int64_t block_size) {
    const int64_t head_stride = pool_blocks * block_size * head_dim;
    const auto copy = [head_dim](const T* from, C* to) {
        if constexpr (std::is_same_v<T, C>) {
            std::memcpy(to, from, head_dim * sizeof(T));
        } else {
            for (int64_t d = 0; d < head_dim; ++d) tokenmill::store(tokenmill::to_float(from[d]), to + d);
        }
    };
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        const int64_t offset = (slot / block_size) * block_size * head_dim + (slot % block_size) * head_dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
            copy(key + t * key_stride + h * head_dim, key_cache + h * head_stride + offset);
            copy(value + t * value_stride + h * head_dim, value_cache + h * head_stride + offset);
        }
    }
}

}  // namespace

// The caches travel as void pointers: the decode stack calls this for every cache element type through one
// function pointer type (kernels/csrc/decode_stack_cpu.cpp).
#define TOKENMILL_EXPORT_STORE_KV(SUFFIX, T, C)                                                                   \
    void tokenmill_store_kv_##SUFFIX(const T* key, const T* value, int64_t key_stride, int64_t value_stride,      \
                                     void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens,    \
                                     int64_t kv_heads, int64_t head_dim, int64_t pool_blocks, int64_t block_size) { \
        store_kv(key, value, key_stride, value_stride, static_cast<C*>(key_cache), static_cast<C*>(value_cache),   \
                 slots, tokens, kv_heads, head_dim, pool_blocks, block_size);                                      \
    }

#define TOKENMILL_EXPORT(SUFFIX, T)                                                                                \
    void tokenmill_rms_norm_##SUFFIX(const T* x, const T* residual, const T* weight, T* out, T* new_residual,     \
                                     int64_t rows, int64_t hidden, float eps, int threads) {                      \
        rms_norm(x, residual, weight, out, new_residual, rows, hidden, eps, threads);                              \
    }                                                                                                              \
    void tokenmill_rotary_##SUFFIX(T* x, int64_t token_stride, const int64_t* positions, const float* cos_sin,    \
                                   int64_t tokens, int64_t heads, int64_t head_dim, int threads) {                \
        rotate(x, token_stride, positions, cos_sin, tokens, heads, head_dim, threads);                             \
    }                                                                                                              \
    void tokenmill_silu_and_mul_##SUFFIX(const T* x, T* out, int64_t rows, int64_t ffn, int threads) {            \
        silu_and_mul(x, out, rows, ffn, threads);                                                                  \
    }                                                                                                              \
    TOKENMILL_EXPORT_STORE_KV(SUFFIX, T, T)

extern "C" {
TOKENMILL_EXPORT(f32, float)
TOKENMILL_EXPORT(bf16, uint16_t)
TOKENMILL_EXPORT_STORE_KV(f32_bf16kv, float, uint16_t)
}
