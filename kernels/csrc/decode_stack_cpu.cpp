// The decoder layers of a decode step (one new token per sequence) in one native call.
//
// Why: at one to a few streams a step's matmuls take ~8 ms, and the ~300 small calls around them (two
// norms, rotary, the KV store, attention, SiLU, four linears per layer, each a Python wrapper, a tensor
// allocation and a ctypes crossing) took as long again. This loop makes the same calls, in the same order,
// to the same kernels, with the same thread count, so its output equals the per-op path bit for bit: the
// kernels come in as function pointers from their own libraries (kernels/csrc/*.cpp), each built with its
// own flags (elementwise_cpu's -ffp-contract=off rounding stays its own).
//
// Per layer, as engine/models/llama.py's LlamaForCausalLM.forward:
//   normed, residual = rms_norm(hidden, input_norm, residual)    (the first layer: residual = hidden)
//   qkv = qkv_proj(normed); rotate q and k in place; store k, v in the pool
//   hidden = o_proj(paged_decode(q))
//   normed, residual = rms_norm(hidden, post_attention_norm, residual)
//   hidden = down_proj(silu_and_mul(gate_up_proj(normed)))
// and at the end out = rms_norm(hidden, final_norm, residual).
// With a step's LoRA adapters (`lora`, kernels/lora.py), each linear's output gets their deltas right after it
// (kernels/csrc/lora_cpu.cpp, through its pointer), before anything reads it: q/k/v before the rotary.
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
struct KernelTypes {
    using QLinear = void (*)(const T*, T*, int64_t, int64_t, int64_t, int, const void*, const uint16_t*,
                             const uint16_t*, int64_t, const float*, int);
    using RmsNorm = void (*)(const T*, const T*, const T*, T*, T*, int64_t, int64_t, float, int);
    using Rotary = void (*)(T*, int64_t, const int64_t*, const float*, int64_t, int64_t, int64_t, int);
    using SiluAndMul = void (*)(const T*, T*, int64_t, int64_t, int);
    // caches of any element type (the activations' or bfloat16): the kernels take them as void pointers
    using StoreKv = void (*)(const T*, const T*, int64_t, int64_t, void*, void*, const int64_t*, int64_t, int64_t,
                             int64_t, int64_t, int64_t);
    using PagedDecode = void (*)(const T*, const void*, const void*, const int32_t*, const int32_t*, T*, int64_t,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
    using LoraAdd = int (*)(const void*, int64_t, const T*, int64_t, int64_t, T*, int64_t, int64_t, int);
};

}  // namespace

// The structs mirror kernels/decode_stack.py's ctypes Structures field for field (all 8-byte fields).
struct TokenmillKernels {
    void* qlinear;
    void* rms_norm;
    void* rotary;
    void* silu_and_mul;
    void* store_kv;
    void* paged_decode;
};

struct TokenmillLinear {  // a packed weight, as kernels/qlinear.py's PackedWeight
    const void* packed;
    const uint16_t* scales;
    const uint16_t* mins;
    const float* bias;
    int64_t in_features, out_features, group, format;
};

struct TokenmillLayer {
    const void* input_norm;
    const void* post_attention_norm;
    void* key_cache;  // heads-major [kv_heads, pool_blocks, block_size, head_dim]
    void* value_cache;
    TokenmillLinear qkv, o, gate_up, down;
    // packed == null: none. Else q/k/v's outputs past qkv's (a fused linear whose parts keep different formats:
    // Q4_K_M's q/k in int4k, its Q6_K v in int6k), computed apart and placed after them in each row.
    TokenmillLinear qkv_tail;
};

struct TokenmillModel {
    int64_t layers, hidden, heads, kv_heads, head_dim, ffn, block_size, pool_blocks;
    double eps, scale;  // passed on as float, as the per-op path's ctypes does
    const float* cos_sin;  // [positions, 2, head_dim]
    const void* final_norm;
    const TokenmillLayer* layer;
    TokenmillKernels kernels;
};

struct TokenmillStep {
    int64_t rows, table_stride;
    const int64_t* positions;  // [rows]
    const int64_t* slots;      // [rows]
    const int32_t* block_tables;  // [rows, table_stride]
    const int32_t* context_lens;  // [rows]
    const void* lora_add;  // null, or kernels/csrc/lora_cpu.cpp's tokenmill_lora_add for the activations' type
    const void* lora;      // its TokenmillLoraStep: the rows each adapter runs (rows sorted by adapter)
};

namespace {

template <typename T>
void run_layers(const TokenmillModel& m, const TokenmillStep& s, const T* embedded, T* out, int threads) {
    using K = KernelTypes<T>;
    const auto qlinear = reinterpret_cast<typename K::QLinear>(m.kernels.qlinear);
    const auto rms_norm = reinterpret_cast<typename K::RmsNorm>(m.kernels.rms_norm);
    const auto rotary = reinterpret_cast<typename K::Rotary>(m.kernels.rotary);
    const auto silu_and_mul = reinterpret_cast<typename K::SiluAndMul>(m.kernels.silu_and_mul);
    const auto store_kv = reinterpret_cast<typename K::StoreKv>(m.kernels.store_kv);
    const auto paged_decode = reinterpret_cast<typename K::PagedDecode>(m.kernels.paged_decode);
    const auto lora_add = reinterpret_cast<typename K::LoraAdd>(s.lora_add);
    int64_t layer_index = 0;
    // which: the linear's place in the layer (qkv 0, o 1, gate_up 2, down 3), as kernels/lora.py numbers them
    const auto matmul = [&](const TokenmillLinear& w, const T* x, T* y) {
        qlinear(x, y, s.rows, w.in_features, w.out_features, static_cast<int>(w.format), w.packed, w.scales, w.mins,
                w.group, w.bias, threads);
    };
    const auto add_lora = [&](const T* x, int64_t in_features, T* y, int64_t out_features, int64_t which) {
        if (lora_add != nullptr)  // (an adapter that does not fit the shapes, which registration refuses, adds nothing)
            lora_add(s.lora, layer_index * 4 + which, x, in_features, in_features, y, out_features, out_features,
                     threads);
    };
    const auto linear = [&](const TokenmillLinear& w, const T* x, T* y, int64_t which) {
        matmul(w, x, y);
        add_lora(x, w.in_features, y, w.out_features, which);
    };
    const int64_t rows = s.rows, hidden = m.hidden;
    const int64_t q_size = m.heads * m.head_dim, kv_size = m.kv_heads * m.head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const float eps = static_cast<float>(m.eps), scale = static_cast<float>(m.scale);

    static thread_local std::vector<T> x, residual, normed, qkv, attention, gate_up, activated, head_part, tail_part;
    x.resize(rows * hidden);
    residual.resize(rows * hidden);
    normed.resize(rows * hidden);
    qkv.resize(rows * qkv_width);
    attention.resize(rows * q_size);
    gate_up.resize(rows * 2 * m.ffn);
    activated.resize(rows * m.ffn);
    std::memcpy(residual.data(), embedded, rows * hidden * sizeof(T));

    for (int64_t i = 0; i < m.layers; ++i) {
        const TokenmillLayer& layer = m.layer[i];
        layer_index = i;
        const T* input_norm = static_cast<const T*>(layer.input_norm);
        if (i == 0)
            rms_norm(residual.data(), nullptr, input_norm, normed.data(), residual.data(), rows, hidden, eps, threads);
        else
            rms_norm(x.data(), residual.data(), input_norm, normed.data(), residual.data(), rows, hidden, eps, threads);
        if (layer.qkv_tail.packed == nullptr) {
            linear(layer.qkv, normed.data(), qkv.data(), 0);
        } else {  // the two parts apart, then side by side in each row
            const int64_t head_width = layer.qkv.out_features, tail_width = layer.qkv_tail.out_features;
            head_part.resize(rows * head_width);
            tail_part.resize(rows * tail_width);
            matmul(layer.qkv, normed.data(), head_part.data());
            matmul(layer.qkv_tail, normed.data(), tail_part.data());
            for (int64_t r = 0; r < rows; ++r) {
                std::memcpy(qkv.data() + r * qkv_width, head_part.data() + r * head_width, head_width * sizeof(T));
                std::memcpy(qkv.data() + r * qkv_width + head_width, tail_part.data() + r * tail_width,
                            tail_width * sizeof(T));
            }
            add_lora(normed.data(), hidden, qkv.data(), qkv_width, 0);
        }
        T* q = qkv.data();
        T* k = q + q_size;
        T* v = k + kv_size;
        rotary(q, qkv_width, s.positions, m.cos_sin, rows, m.heads, m.head_dim, threads);
        rotary(k, qkv_width, s.positions, m.cos_sin, rows, m.kv_heads, m.head_dim, threads);
        store_kv(k, v, qkv_width, qkv_width, layer.key_cache, layer.value_cache, s.slots, rows, m.kv_heads,
                 m.head_dim, m.pool_blocks, m.block_size);
        paged_decode(q, layer.key_cache, layer.value_cache, s.block_tables, s.context_lens, attention.data(), rows,
                     m.heads, m.kv_heads, m.head_dim, m.block_size, m.pool_blocks, s.table_stride, qkv_width, scale,
                     threads);
        linear(layer.o, attention.data(), x.data(), 1);
        rms_norm(x.data(), residual.data(), static_cast<const T*>(layer.post_attention_norm), normed.data(),
                 residual.data(), rows, hidden, eps, threads);
        linear(layer.gate_up, normed.data(), gate_up.data(), 2);
        silu_and_mul(gate_up.data(), activated.data(), rows, m.ffn, threads);
        linear(layer.down, activated.data(), x.data(), 3);
    }
    rms_norm(x.data(), residual.data(), static_cast<const T*>(m.final_norm), out, residual.data(), rows, hidden, eps,
             threads);
}

}  // namespace

extern "C" {

void tokenmill_decode_stack_f32(const TokenmillModel* model, const TokenmillStep* step, const float* embedded,
                                float* out, int threads) {
    run_layers(*model, *step, embedded, out, threads);
}

void tokenmill_decode_stack_bf16(const TokenmillModel* model, const TokenmillStep* step, const uint16_t* embedded,
                                 uint16_t* out, int threads) {
    run_layers(*model, *step, embedded, out, threads);
}

}  // extern "C"
