// LoRA adapters' low-rank deltas for one fused linear of a step (engine/lora.py), in one native call:
// for each segment of rows [start, end) run under an adapter, out[rows] += B (A x[rows]), where A stacks the
// fused linear's modules' lora_A rows (q, k, v for qkv_proj) and each module's B (scaled, transposed) adds into
// its own columns of the output. Rows outside every segment (the base model's) are not touched.
//
// Why native code: in torch each segment costs a shrink matmul and an expand per module, ~11 small matmuls a
// layer per adapter, each a thread-pool wake-up and MKL's small-matrix path (25-45 us each on the 2-core EPYC
// machines, for ~1 us of arithmetic); 8 rows over 4 adapters doubled a decode step of SmolLM2-135M. Here a
// fused linear is one call: every segment's dot products, then every segment's expand (one parallel region
// for a large call), reading each adapter's matrices once.
//
// Sums: float, in lanes (-ffp-contract=fast); bfloat16 activations round the shrunk values to bfloat16 (as
// torch's matmul in that dtype) and add the delta to the output with one rounding.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bfloat16.h"

// The structs mirror kernels/lora.py's ctypes Structures field for field (all 8-byte fields).
struct TokenmillLoraPiece {  // one module of the fused linear
    int64_t rank_start, rank_end;  // its rows of A (and of the shrunk values)
    int64_t col_start, col_end;    // its columns of the fused output
    const void* b_t;               // [rank_end - rank_start, col_end - col_start], scaled
};

struct TokenmillLoraLinear {  // one adapter's matrices for one fused linear of one layer
    const void* a;             // [rank, in_features], the modules' lora_A stacked; null: the adapter skips it
    int64_t rank, in_features, pieces;
    TokenmillLoraPiece piece[3];
};

struct TokenmillLoraStep {
    int64_t segments;
    const int64_t* starts;  // [segments] first row
    const int64_t* ends;    // [segments] one past the last row
    const TokenmillLoraLinear* const* tables;  // [segments] -> the adapter's [layers * 4] linears
};

namespace {

using tokenmill::round_to;
using tokenmill::store;
using tokenmill::to_float;

// One vector register of floats in GCC's vector extension (16 lanes with AVX-512, else 8: AVX2's, or a loop
// elsewhere), and as many rows of x per block as keep a block's sums and loads in the 32 (16) registers.
// `aligned` lets a dereference load from any element's address, `may_alias` read the element type's memory.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kBlockRows = 4;
#else
constexpr int kLanes = 8;
constexpr int kBlockRows = 2;
#endif
typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));
typedef uint32_t Bits __attribute__((vector_size(kLanes * 4)));
typedef uint16_t HalfBits __attribute__((vector_size(kLanes * 2), aligned(2), may_alias));

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline Vec load(const uint16_t* p) {  // bfloat16: its bits are a float's upper half
    const Bits bits = __builtin_convertvector(*reinterpret_cast<const HalfBits*>(p), Bits) << 16;
    return (Vec)bits;  // a vector cast between types of one size keeps the bits
}
inline float lane_sum(Vec v) {
    float sum = 0.f;
    for (int i = 0; i < kLanes; ++i) sum += v[i];
    return sum;
}

constexpr int64_t kPrefetchFloats = 256;  // 1 KB ahead in a row of A
constexpr int64_t kPrefetchRows = 4;  // rows of B ahead
constexpr int kRankRows = 4;  // rows of A per shrink work item (each of them read once for all its x rows)
constexpr int64_t kColumns = 4 * kLanes;  // output columns per expand work item: four vectors
// Below this many multiply-adds a call runs on the calling thread. A decode step's calls (8 rows over 4 rank-16
// adapters of SmolLM2: 0.15-0.55 M each) are a read of the adapters' matrices, which one core streams at ~25
// GB/s; waking OpenMP workers for each of the step's 120 calls (this library's libgomp pool, beside torch's)
// cost more than a second core saved on the 2-core machines under load: bench/lora_bench.py, adapters' tok/s
// over the base's, 2 threads against 1: 0.80 / 0.79 against 0.84 / 0.82 with OMP_WAIT_POLICY=PASSIVE, 0.60
// against 0.92 with ACTIVE (the server's default, app/openmp.py). Prefill chunks (hundreds of rows) split.
constexpr int64_t kParallelWork = 1 << 22;

// t[r * width + j] = x_r . a_j for R rows of x and J rows of A: R*J independent vector sums.
template <int R, int J, typename T>
inline void shrink_block(const T* x, int64_t x_stride, const T* a, int64_t in, float* t, int64_t width) {
    Vec sums[R][J] = {};
    int64_t k = 0;
    for (; k + kLanes <= in; k += kLanes) {
        Vec a_k[J];
        for (int j = 0; j < J; ++j) {
            __builtin_prefetch(a + j * in + k + kPrefetchFloats);
            a_k[j] = load(a + j * in + k);
        }
        for (int r = 0; r < R; ++r) {
            const Vec x_k = load(x + r * x_stride + k);
            for (int j = 0; j < J; ++j) sums[r][j] += x_k * a_k[j];
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int j = 0; j < J; ++j) {
            float sum = lane_sum(sums[r][j]);
            for (int64_t tail = k; tail < in; ++tail) sum += to_float(x[r * x_stride + tail]) * to_float(a[j * in + tail]);
            t[r * width + j] = round_to<T>(sum);  // bfloat16: the shrunk values in the dtype, as torch's matmul
        }
    }
}

template <int J, typename T>
inline void shrink_rows(const T* x, int64_t x_stride, int64_t rows, const T* a, int64_t in, float* t, int64_t width) {
    int64_t r = 0;
    for (; r + kBlockRows <= rows; r += kBlockRows)
        shrink_block<kBlockRows, J>(x + r * x_stride, x_stride, a, in, t + r * width, width);
    for (; r + 2 <= rows; r += 2) shrink_block<2, J>(x + r * x_stride, x_stride, a, in, t + r * width, width);
    if (r < rows) shrink_block<1, J>(x + r * x_stride, x_stride, a, in, t + r * width, width);
}

// out[r, 0:kColumns] += sum_j t[r * width + j] * b[j * b_stride, 0:kColumns] for R rows: a whole block of columns.
template <int R, typename T>
inline void expand_block(const float* t, int64_t width, int64_t rank, const T* b, int64_t b_stride, T* out,
                         int64_t out_stride) {
    constexpr int kVecs = kColumns / kLanes;
    Vec sums[R][kVecs] = {};
    for (int64_t j = 0; j < rank; ++j) {
        Vec b_j[kVecs];
        for (int v = 0; v < kVecs; ++v) {
            __builtin_prefetch(b + (j + kPrefetchRows) * b_stride + v * kLanes);
            b_j[v] = load(b + j * b_stride + v * kLanes);
        }
        for (int r = 0; r < R; ++r) {
            const float t_rj = t[r * width + j];
            for (int v = 0; v < kVecs; ++v) sums[r][v] += t_rj * b_j[v];
        }
    }
    for (int r = 0; r < R; ++r) {
        T* o = out + r * out_stride;
        for (int v = 0; v < kVecs; ++v) {
            const Vec summed = load(o + v * kLanes) + sums[r][v];
            for (int i = 0; i < kLanes; ++i) store(summed[i], o + v * kLanes + i);
        }
    }
}

// The same for fewer columns than a block (a module's last, partial block).
template <typename T>
inline void expand_tail(const float* t, int64_t rank, const T* b, int64_t b_stride, T* out, int64_t columns) {
    float sums[kColumns] = {};
    for (int64_t j = 0; j < rank; ++j) {
        const float t_j = t[j];
        for (int64_t c = 0; c < columns; ++c) sums[c] += t_j * to_float(b[j * b_stride + c]);
    }
    for (int64_t c = 0; c < columns; ++c) store(to_float(out[c]) + sums[c], out + c);
}

struct ShrinkItem {
    int64_t segment, rank_row;  // rows rank_row .. rank_row + kRankRows of the segment's A (fewer at its end)
};
struct ExpandItem {
    int64_t segment, piece, col;  // columns col .. col + kColumns of the piece (fewer at its end)
};

// Returns 0, or -1 (and adds nothing) where an adapter's matrices do not fit x's or out's columns.
template <typename T>
int lora_add(const TokenmillLoraStep& step, int64_t linear, const T* x, int64_t x_stride, int64_t x_columns, T* out,
             int64_t out_stride, int64_t out_columns, int threads) {
    static thread_local std::vector<ShrinkItem> shrink_items;
    static thread_local std::vector<ExpandItem> expand_items;
    static thread_local std::vector<float> shrunk;
    shrink_items.clear();
    expand_items.clear();
    int64_t rows = 0, width = 0, work = 0;
    for (int64_t s = 0; s < step.segments; ++s) {
        const TokenmillLoraLinear& w = step.tables[s][linear];
        if (w.a == nullptr) continue;
        if (w.in_features != x_columns) return -1;
        const int64_t segment_rows = step.ends[s] - step.starts[s];
        rows = std::max(rows, step.ends[s]);
        width = std::max(width, w.rank);
        for (int64_t j = 0; j < w.rank; j += kRankRows) shrink_items.push_back({s, j});
        work += segment_rows * w.rank * w.in_features;
        for (int64_t p = 0; p < w.pieces; ++p) {
            const TokenmillLoraPiece& piece = w.piece[p];
            if (piece.col_end > out_columns || piece.rank_end > w.rank) return -1;
            for (int64_t c = piece.col_start; c < piece.col_end; c += kColumns) expand_items.push_back({s, p, c});
            work += segment_rows * (piece.rank_end - piece.rank_start) * (piece.col_end - piece.col_start);
        }
    }
    if (shrink_items.empty()) return 0;
    shrunk.resize(rows * width);  // row r's shrunk values at r * width
    float* const t = shrunk.data();
    const int64_t shrink_count = static_cast<int64_t>(shrink_items.size());
    const int64_t expand_count = static_cast<int64_t>(expand_items.size());
    const ShrinkItem* const shrink = shrink_items.data();
    const ExpandItem* const expand = expand_items.data();

    const auto shrink_one = [&](int64_t i) {
        const int64_t s = shrink[i].segment, j = shrink[i].rank_row;
        const TokenmillLoraLinear& w = step.tables[s][linear];
        const int64_t in = w.in_features, start = step.starts[s], segment_rows = step.ends[s] - start;
        const T* a = static_cast<const T*>(w.a) + j * in;
        const T* x_rows = x + start * x_stride;
        float* t_rows = t + start * width + j;
        switch (std::min<int64_t>(kRankRows, w.rank - j)) {
            case 4: shrink_rows<4>(x_rows, x_stride, segment_rows, a, in, t_rows, width); break;
            case 3: shrink_rows<3>(x_rows, x_stride, segment_rows, a, in, t_rows, width); break;
            case 2: shrink_rows<2>(x_rows, x_stride, segment_rows, a, in, t_rows, width); break;
            default: shrink_rows<1>(x_rows, x_stride, segment_rows, a, in, t_rows, width); break;
        }
    };
    const auto expand_one = [&](int64_t i) {
        const int64_t s = expand[i].segment, col = expand[i].col;
        const TokenmillLoraPiece& piece = step.tables[s][linear].piece[expand[i].piece];
        const int64_t b_stride = piece.col_end - piece.col_start, rank = piece.rank_end - piece.rank_start;
        const T* b = static_cast<const T*>(piece.b_t) + (col - piece.col_start);
        const int64_t start = step.starts[s], end = step.ends[s];
        const float* t_rows = t + piece.rank_start;
        if (piece.col_end - col < kColumns) {
            for (int64_t r = start; r < end; ++r)
                expand_tail(t_rows + r * width, rank, b, b_stride, out + r * out_stride + col, piece.col_end - col);
            return;
        }
        int64_t r = start;
        for (; r + kBlockRows <= end; r += kBlockRows)
            expand_block<kBlockRows>(t_rows + r * width, width, rank, b, b_stride, out + r * out_stride + col,
                                     out_stride);
        for (; r + 2 <= end; r += 2)
            expand_block<2>(t_rows + r * width, width, rank, b, b_stride, out + r * out_stride + col, out_stride);
        if (r < end)
            expand_block<1>(t_rows + r * width, width, rank, b, b_stride, out + r * out_stride + col, out_stride);
    };
    // Not `omp parallel if (...)`: libgomp sets up a team even for one thread, ~1.5 us, as long as a small call.
    if (threads > 1 && work >= kParallelWork) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < shrink_count; ++i) shrink_one(i);
            // (the implicit barrier of the loop above: every shrunk value is in place)
#pragma omp for schedule(static)
            for (int64_t i = 0; i < expand_count; ++i) expand_one(i);
        }
    } else {
        for (int64_t i = 0; i < shrink_count; ++i) shrink_one(i);
        for (int64_t i = 0; i < expand_count; ++i) expand_one(i);
    }
    return 0;
}

}  // namespace

extern "C" {

int tokenmill_lora_add_f32(const TokenmillLoraStep* step, int64_t linear, const float* x, int64_t x_stride,
                           int64_t x_columns, float* out, int64_t out_stride, int64_t out_columns, int threads) {
    return lora_add(*step, linear, x, x_stride, x_columns, out, out_stride, out_columns, threads);
}

int tokenmill_lora_add_bf16(const TokenmillLoraStep* step, int64_t linear, const uint16_t* x, int64_t x_stride,
                            int64_t x_columns, uint16_t* out, int64_t out_stride, int64_t out_columns, int threads) {
    return lora_add(*step, linear, x, x_stride, x_columns, out, out_stride, out_columns, threads);
}

}  // extern "C"
