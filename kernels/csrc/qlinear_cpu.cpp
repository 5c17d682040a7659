// y = x @ W.T (+ bias) for weights packed at load time, bfloat16 or weight-only int8 / int4 with group
// scales, dequantized in registers. Built for the rows a decode step has (1 to a few dozen): there the
// time is reading the weights once, so the weights stream from memory in their smallest form and each
// value loaded is used for every row of x while it sits in a register.
//
// Packed layout (kernels/qlinear.py writes it): the output features are cut into blocks of 16 lanes (one
// zmm of float32 or int32), N padded with zero rows to a multiple of kTileBlocks*16, so no horizontal sums.
//   bf16: uint16 [blocks][K][16]: a float32 FMA per k for every row of x.
//   int8: uint8 [blocks][Kp/4][16][4] holding q + 128, fp16 scales [blocks][groups][16]; w = q * scale.
//   int4: uint8 [blocks][Kp/32][4][16][4]: byte (c, lane, j) holds q[k = 4c + j] in its low nibble and
//         q[k = 16 + 4c + j] in its high nibble, for the 32 k of one group; fp16 scale and min
//         [blocks][groups][16]; w = q * scale + min, q in 0..15 (GGUF Q4_1 style), groups of 32.
//   int4k: GGUF's Q4_K as stored: int4's codes, and per 256 inputs (a super block of 8 groups) a float16 d and
//         dmin per lane with each group's 6-bit scale sc and minimum m as bytes: w = d * sc * q - dmin * m.
//         Scales [blocks][K/256][sc 8x16 | m 8x16 | d 16 x f16 | dmin 16 x f16] (320 bytes): 4.625 bits a weight
//         against int4's 5, and d * sc, dmin * m are exact in float32 (int4's float16 scale rounds them).
//   int6k: GGUF's Q6_K as stored: q in 0..63, w = d * sc * (q - 32), sc an int8 per 16 inputs, d a float16 per
//         256. Per block and group of 32, 384 bytes: int4's layout of the low 4 bits (256), then the high 2 bits
//         of inputs 0-15 (64) and of 16-31 (64), byte (lane, j) holding those of chunks c = 0..3 at bits 4-5,
//         6-7, 0-1, 2-3 (so each is one shift and a mask from bits 4-5). Scales [blocks][K/256][sc 8 groups x 2
//         halves x 16 | d 16 x f16] (288 bytes): 6.5625 bits a weight, where int8 took 8.5.
// Kp = groups * group >= K (zero padded), a multiple of 32 (of 256 for int4k and int6k).
// The int formats run as integer dot products (AVX512-VNNI: one vpdpbusd multiplies 64 weight bytes by 4
// bytes of x). x is quantized per row and block of 32 inputs as two int8 digits, x ~ s*(hi + lo/256) with
// s = max|x|/127: hi = round(x/s), lo = round((x - s*hi) / (s/256)) in -128..127 (lo = 128, a remainder within
// 0.4% of half a step, carries into hi). One digit (llama.cpp's Q8 activations) moved 1% of SmolLM2's greedy
// tokens away from float activations; two digits are as good as float (16-bit precision) and the second dot
// product is nearly free while the weights stream from memory.
// The int32 sums combine exactly: total = 256*sum(w*hi) + sum(w*lo). For int8: sum_k x*(q+128) - 128*sum_k x
// gives sum_k x*q; for int4: sum_k x*(q*s+m) = s*sum_k(x*q) + m*sum_k(x). AVX2 has no vpdpbusd: it widens
// the weights to int16 and multiplies them with vpmaddwd by both digits at once, as one int16 (see its IVec), or at
// one row multiplies the codes by each digit with the byte product (one_row_nibble_sums);
// without either a portable loop does the same integer arithmetic. The int32 sums are exact in all three, so
// results do not depend on the CPU. Where AMX runs, int4k and int6k take 8 rows and more as tile products of both
// digits at once (amx_block_sums), the same int32 sums and the same float epilogue.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TOKENMILL_VEC "avx512-vnni"
#define TOKENMILL_VNNI 1
#elif defined(__AVX512F__) && defined(__AVX2__)
#include <immintrin.h>
#define TOKENMILL_VEC "avx512"  // without VNNI (x86-64-v4, Skylake-SP): AVX2's integer sums, AVX-512's floats
#define TOKENMILL_AVX2_INT 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_VEC "avx2"
#define TOKENMILL_AVX2_INT 1
#else
#define TOKENMILL_VEC "scalar"
#endif

// AMX (Intel's tile unit, Sapphire Rapids on): one tile product multiplies 16 rows of x by 16 outputs over 32
// inputs, where vpdpbusd takes one row and four inputs. Built where -march=native says the CPU has it; used only
// where the kernel grants the tile state at run time (amx_usable).
#if defined(TOKENMILL_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define TOKENMILL_AMX 1
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "bfloat16.h"

namespace {

constexpr int kLanes = 16;
constexpr int kTileBlocks = 4;  // output blocks per tile (N is padded to whole tiles); a thread's unit is half a tile
constexpr int kXBlock = 32;     // inputs per int8 scale of x
// x ~ s * (high + low / kDigitBase). 256, not 254 (where low never reached 128): joining the digits' sums is one
// shift and an add, where 254 took two shifts, a subtract and an add for each row and x block, in the ports the dot
// products use (2-core EPYC Zen 4: a 1B's 16384x2048 int4k linear 1.03x at 8 and at 256 rows).
constexpr int32_t kDigitBase = 256;
constexpr int kDigitShift = 8;
static_assert(kDigitBase == 1 << kDigitShift, "the digits join with a shift");
// Bytes ahead of each weight load to prefetch, in the thread's one sequential stream of blocks (a block is 4.6 KB
// at K = 576, so this asks for the next block while this one is summed; hardware prefetchers stop at page
// edges): a decode step's matmuls at one row, 2-core EPYC, ~5-10% faster. On Intel half as far ahead: a 1B's
// decode step's linears at one row read their weights at 26.9-27.5 against 25.2-25.6 GB/s (2-core Xeon with AMX,
// weights on huge pages, medians of 3 runs of 5 alternated passes). A prefetch past the end is harmless.
int64_t prefetch_distance() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel")) return 2048;
#endif
    return 4096;
}
const int64_t kPrefetchAhead = prefetch_distance();

// float16 -> float32, exactly (the scalar Vec and the embedding lookup below)
float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            exponent = 127 - 15 + 1;
            while ((mantissa & 0x400u) == 0) {
                mantissa <<= 1;
                --exponent;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

#if defined(__AVX512F__)
struct Vec {
    __m512 v;
    static Vec zero() { return {_mm512_setzero_ps()}; }
    static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
    static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
    static Vec load_bf16(const uint16_t* p) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
    }
    static Vec load_f16(const uint16_t* p) {
        return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
    }
    static Vec load_u8(const uint8_t* p) {
        return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
    }
    static Vec load_i8(const int8_t* p) {
        return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
    }
    static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
    static Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
    static Vec from_halves(__m256 low, __m256 high) {  // lanes 0-7, lanes 8-15
        return {_mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1))};
    }
    void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec {
    __m256 a, b;
    static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Vec broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
    static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static __m256 bf16x8(const uint16_t* p) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    static Vec load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
    static Vec load_f16(const uint16_t* p) {
        return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
    }
    static __m256 bytes8(__m256i wide) { return _mm256_cvtepi32_ps(wide); }
    static Vec load_u8(const uint8_t* p) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return {bytes8(_mm256_cvtepu8_epi32(bytes)), bytes8(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
    }
    static Vec load_i8(const int8_t* p) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return {bytes8(_mm256_cvtepi8_epi32(bytes)), bytes8(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
    }
    static Vec fma(Vec x, Vec y, Vec z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
    static Vec mul(Vec x, Vec y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
    static Vec from_halves(__m256 low, __m256 high) { return {low, high}; }
    void store(float* p) const {
        _mm256_storeu_ps(p, a);
        _mm256_storeu_ps(p + 8, b);
    }
};
#else
struct Vec {
    float v[kLanes];
    static Vec zero() { return broadcast(0.f); }
    static Vec broadcast(float x) {
        Vec out;
        for (float& lane : out.v) lane = x;
        return out;
    }
    static Vec load(const float* p) {
        Vec out;
        std::memcpy(out.v, p, sizeof(out.v));
        return out;
    }
    static Vec load_bf16(const uint16_t* p) {
        Vec out;
        for (int i = 0; i < kLanes; ++i) out.v[i] = tokenmill::to_float(p[i]);
        return out;
    }
    static Vec load_f16(const uint16_t* p) {
        Vec out;
        for (int i = 0; i < kLanes; ++i) out.v[i] = half_to_float(p[i]);
        return out;
    }
    template <typename Byte>
    static Vec load_bytes(const Byte* p) {
        Vec out;
        for (int i = 0; i < kLanes; ++i) out.v[i] = static_cast<float>(p[i]);
        return out;
    }
    static Vec load_u8(const uint8_t* p) { return load_bytes(p); }
    static Vec load_i8(const int8_t* p) { return load_bytes(p); }
    static Vec fma(Vec x, Vec y, Vec z) {
        Vec out;
        for (int i = 0; i < kLanes; ++i) out.v[i] = x.v[i] * y.v[i] + z.v[i];
        return out;
    }
    static Vec mul(Vec x, Vec y) {
        Vec out;
        for (int i = 0; i < kLanes; ++i) out.v[i] = x.v[i] * y.v[i];
        return out;
    }
    void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
};
#endif


// int32 sums of 16 lanes: acc[lane] += sum_j w[lane*4 + j] * x[j], w unsigned bytes, x signed (vpdpbusd).
#if defined(TOKENMILL_VNNI)
struct IVec {
    __m512i v;
    static IVec zero() { return {_mm512_setzero_si512()}; }
    static __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    static void store(__m512i bytes, uint8_t* p) { _mm512_storeu_si512(p, bytes); }
    static __m512i low_nibbles(__m512i bytes) { return _mm512_and_si512(bytes, _mm512_set1_epi8(15)); }
    static __m512i high_nibbles(__m512i bytes) {
        return _mm512_and_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi8(15));
    }
    // int6k: chunk c's high 2 bits (bits 4-5, 6-7, 0-1, 2-3 of `high` for c = 0..3) above 4-bit codes
    static __m512i six_bits(__m512i nibbles, __m512i high, int c) {
        const __m512i moved = c == 0   ? high
                              : c == 1 ? _mm512_srli_epi16(high, 2)
                              : c == 2 ? _mm512_slli_epi16(high, 4)
                                       : _mm512_slli_epi16(high, 2);
        return _mm512_or_si512(nibbles, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
    }
    static __m512i quad(const int8_t* x) {
        int32_t bits;
        std::memcpy(&bits, x, sizeof(bits));
        return _mm512_set1_epi32(bits);
    }
    void dot(__m512i w, __m512i x4) { v = _mm512_dpbusd_epi32(v, w, x4); }
    static IVec combine(IVec high, IVec low) {  // kDigitBase * high + low
        return {_mm512_add_epi32(_mm512_slli_epi32(high.v, kDigitShift), low.v)};
    }
    // float(this - offset) as a Vec
    Vec to_float(int32_t offset) const { return {_mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(offset)))}; }
};
#elif defined(TOKENMILL_AVX2_INT)
// AVX2 has no vpdpbusd, and its byte product (vpmaddubsw) saturates at int16, so the weights are widened to int16
// and multiplied with vpmaddwd (int16 pairs into int32) against x's two digits as one int16, 256 * high + low
// (-32640..32639): the same integer sums as two digit passes, with half the multiplies. Exact in
// int32: a lane's 32 products of one x block are at most 32 * 255 * 32640 = 2.7e8. (vpmaddubsw, the byte product,
// saturates at int16 and needed a pass per digit; widened weights measured 1.0-1.3x for int4 and 1.2-1.5x for int8
// at 2-64 rows, same at one row.)
struct Bytes64 {
    __m256i a, b;  // the bytes of lanes 0-7 and of lanes 8-15
};
struct IVec {  // int32 sums of lanes 0-7 and 8-15
    __m256i a, b;
    static Bytes64 load(const uint8_t* p) {
        return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
    }
    static void store(const Bytes64& bytes, uint8_t* p) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bytes.a);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), bytes.b);
    }
    static Bytes64 low_nibbles(Bytes64 bytes) {
        const __m256i mask = _mm256_set1_epi8(15);
        return {_mm256_and_si256(bytes.a, mask), _mm256_and_si256(bytes.b, mask)};
    }
    static Bytes64 high_nibbles(Bytes64 bytes) {
        const __m256i mask = _mm256_set1_epi8(15);
        return {_mm256_and_si256(_mm256_srli_epi16(bytes.a, 4), mask),
                _mm256_and_si256(_mm256_srli_epi16(bytes.b, 4), mask)};
    }
    static __m256i moved(__m256i high, int c) {
        const __m256i bits = c == 0   ? high
                             : c == 1 ? _mm256_srli_epi16(high, 2)
                             : c == 2 ? _mm256_slli_epi16(high, 4)
                                      : _mm256_slli_epi16(high, 2);
        return _mm256_and_si256(bits, _mm256_set1_epi8(0x30));
    }
    static Bytes64 six_bits(Bytes64 nibbles, Bytes64 high, int c) {  // as the AVX-512 IVec's
        return {_mm256_or_si256(nibbles.a, moved(high.a, c)), _mm256_or_si256(nibbles.b, moved(high.b, c))};
    }
    Vec to_float(int32_t offset) const {
        const __m256i bias = _mm256_set1_epi32(offset);
        return Vec::from_halves(_mm256_cvtepi32_ps(_mm256_sub_epi32(a, bias)),
                                _mm256_cvtepi32_ps(_mm256_sub_epi32(b, bias)));
    }
};
// A ymm of bytes [lane][4 k] (lanes 0-3 in its low 128 bits, 4-7 in its high) as two ymm of int16 [lane 0-7][2 k],
// k 0-1 and k 2-3: vpshufb places each byte in the low half of an int16 and zeroes the high one (index 0x80), so
// one vpmaddwd sums two k of all eight lanes into that lane's int32, in lane order.
struct WidePairs {
    __m256i a01, a23, b01, b23;  // lanes 0-7, then 8-15; k 0-1, then k 2-3
};
inline __m256i pair_indices(int first) {  // byte 4 * lane + first + {0, 1} of each 128-bit half, zero-extended
    const auto at = [first](int lane, int j) { return static_cast<char>(4 * lane + first + j); };
    const char zero = static_cast<char>(0x80);
    const __m128i half = _mm_setr_epi8(at(0, 0), zero, at(0, 1), zero, at(1, 0), zero, at(1, 1), zero, at(2, 0), zero,
                                       at(2, 1), zero, at(3, 0), zero, at(3, 1), zero);
    return _mm256_broadcastsi128_si256(half);
}
WidePairs widened(Bytes64 w) {
    const __m256i first = pair_indices(0), second = pair_indices(2);
    return {_mm256_shuffle_epi8(w.a, first), _mm256_shuffle_epi8(w.a, second), _mm256_shuffle_epi8(w.b, first),
            _mm256_shuffle_epi8(w.b, second)};
}
// x's inputs k..k+3 as two int16 pairs, each in every 32 bits
struct XPairs {
    __m256i k01, k23;
};
// Per lane, in lane order: two ymm a row. With each lane's two k pairs summed apart (vpunpck widening) a row took
// four and only two rows fit beside the widened weights; with two, four rows do, and the weights are widened once
// for four rows, not two (2-core EPYC Zen 3: one block in L1 0.96 against 1.25-1.58 ns per 64 multiply-adds; a
// decode step's matmuls 0.92-0.95x at 4 rows, 0.88-0.92x at 8, 0.87-0.90x at 64-256, same bits).
struct DigitSums {
    __m256i a, b;
    static DigitSums zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
    void dot(const WidePairs& w, const XPairs& x) {
        a = _mm256_add_epi32(a, _mm256_madd_epi16(w.a01, x.k01));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(w.b01, x.k01));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(w.a23, x.k23));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(w.b23, x.k23));
        // Adds each product as it comes, in registers: left alone, GCC reassociates the integer adds into one
        // tree per x block and holds the products until then, spilling most of them to the stack (pinned:
        // a decode step's matmuls 1.1-1.3x for int4 at 1-64 rows, 1.3-1.7x for int8 from 4 rows).
        asm("" : "+x"(a), "+x"(b));
    }
    IVec total() const { return {a, b}; }
};
// One row's sums by the byte product (vpmaddubsw: codes of a byte each, unsigned, times x's digits, signed), one
// int16 pair sum per lane and two inputs for each digit, with no widening of the codes: as many multiplies and adds
// as the widened codes' vpmaddwd by both digits at once, without the shuffles that widen them. With more rows one
// widening serves four (block_sums), so they keep it. The callers bound the int16 sums below saturation.
struct ByteDigitSums {
    __m256i high_a, high_b, low_a, low_b;  // lanes 0-7, 8-15
    static ByteDigitSums zero() {
        const __m256i z = _mm256_setzero_si256();
        return {z, z, z, z};
    }
    // codes (lane, j) times inputs j = 0..3 from `high` and `low`
    void add(const Bytes64& codes, const int8_t* high, const int8_t* low) {
        int32_t high4, low4;
        std::memcpy(&high4, high, sizeof(high4));
        std::memcpy(&low4, low, sizeof(low4));
        const __m256i x_high = _mm256_set1_epi32(high4), x_low = _mm256_set1_epi32(low4);
        high_a = _mm256_add_epi16(high_a, _mm256_maddubs_epi16(codes.a, x_high));
        high_b = _mm256_add_epi16(high_b, _mm256_maddubs_epi16(codes.b, x_high));
        low_a = _mm256_add_epi16(low_a, _mm256_maddubs_epi16(codes.a, x_low));
        low_b = _mm256_add_epi16(low_b, _mm256_maddubs_epi16(codes.b, x_low));
        // in order, in registers, as DigitSums::dot's (without it one_row_nibble_sums ran 0.97x the widened loop)
        asm("" : "+x"(high_a), "+x"(high_b), "+x"(low_a), "+x"(low_b));
    }
    IVec total() const {  // kDigitBase * high + low per lane in int32, each widened by a vpmaddwd
        const __m256i base = _mm256_set1_epi16(kDigitBase), ones = _mm256_set1_epi16(1);
        return {_mm256_add_epi32(_mm256_madd_epi16(high_a, base), _mm256_madd_epi16(low_a, ones)),
                _mm256_add_epi32(_mm256_madd_epi16(high_b, base), _mm256_madd_epi16(low_b, ones))};
    }
};
// One row of int4 / int4k, one x block, by the byte product: a pair sum of nibbles is at most 2 * 15 * 128 = 3840,
// so a lane's eight of an x block add up in int16 without saturating (<= 30720). The same int32 sums, so the same
// bits. A decode step at one row is bound by this loop on a 2-core EPYC Zen 4 whose AVX-512 the VM hides (a 1B's
// 16384x2048 int4k linear read 14 GB/s on one thread from memory and as much from L3, against a 30 GB/s plain
// read): a 2048x2048 one from L3 ran 1.22x as fast as the widened loop on one thread (16.8-17.1 against 13.8-14.0
// GB/s, alternated), SmolLM2's int4 decode-step linears 1.3x on two; `realsize_bench` one stream, with
// one_row_int6k_sums below, 1.03x llama-server's where it was 0.80-0.86x.
inline IVec one_row_nibble_sums(const uint8_t* chunks, const int8_t* high, const int8_t* low) {
    ByteDigitSums sums = ByteDigitSums::zero();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
        const uint8_t* at = chunks + 64 * c;
        __builtin_prefetch(at + kPrefetchAhead);
        const Bytes64 packed = IVec::load(at);
        // the low nibbles against inputs 4c..4c+3, the high ones against 16 further
        sums.add(IVec::low_nibbles(packed), high + 4 * c, low + 4 * c);
        sums.add(IVec::high_nibbles(packed), high + 4 * c + 16, low + 4 * c + 16);
    }
    return sums.total();
}
#else
struct Bytes64 {
    uint8_t b[64];
};
struct Quad {
    int32_t x[4];
};
struct IVec {
    int32_t v[kLanes];
    static IVec zero() {
        IVec out;
        for (int32_t& lane : out.v) lane = 0;
        return out;
    }
    static Bytes64 load(const uint8_t* p) {
        Bytes64 out;
        std::memcpy(out.b, p, 64);
        return out;
    }
    static void store(const Bytes64& bytes, uint8_t* p) { std::memcpy(p, bytes.b, 64); }
    static Bytes64 low_nibbles(Bytes64 bytes) {
        for (uint8_t& b : bytes.b) b &= 15;
        return bytes;
    }
    static Bytes64 high_nibbles(Bytes64 bytes) {
        for (uint8_t& b : bytes.b) b >>= 4;
        return bytes;
    }
    static Bytes64 six_bits(Bytes64 nibbles, const Bytes64& high, int c) {  // as the AVX-512 IVec's
        static constexpr int kShift[4] = {4, 6, 0, 2};
        for (int i = 0; i < 64; ++i) nibbles.b[i] |= static_cast<uint8_t>(((high.b[i] >> kShift[c]) & 3) << 4);
        return nibbles;
    }
    static Quad quad(const int8_t* x) { return {{x[0], x[1], x[2], x[3]}}; }
    void dot(const Bytes64& w, const Quad& x4) {
        for (int lane = 0; lane < kLanes; ++lane)
            for (int j = 0; j < 4; ++j) v[lane] += static_cast<int32_t>(w.b[lane * 4 + j]) * x4.x[j];
    }
    static IVec combine(IVec high, IVec low) {
        IVec out;
        for (int lane = 0; lane < kLanes; ++lane) out.v[lane] = kDigitBase * high.v[lane] + low.v[lane];
        return out;
    }
    Vec to_float(int32_t offset) const {
        alignas(64) float lanes[kLanes];
        for (int lane = 0; lane < kLanes; ++lane) lanes[lane] = static_cast<float>(v[lane] - offset);
        return Vec::load(lanes);
    }
};
#endif

enum Format : int { kBf16 = 0, kInt8 = 1, kInt4 = 2, kInt4K = 3, kInt6K = 4 };
constexpr int64_t kSuperGroups = 8;       // int4k, int6k: groups of 32 per super block of 256 inputs
constexpr int64_t kInt4KSuperBytes = 320;  // per block and super block: sc, m, d, dmin (see the top)
constexpr int64_t kInt6KSuperBytes = 288;  // sc, d
constexpr int64_t kInt6KGroupBytes = 384;  // per block and group: low nibbles, then the high bits
constexpr bool four_bit(Format f) { return f == kInt4 || f == kInt4K; }

// Per row of x and block of 32 inputs, the terms of the epilogue, computed once per call, not per output block
// (a division per row, block and output block was the epilogue's slowest step).
struct XBlockTerms {
    float low_scale;  // s / 256, the step of the low digit: x ~ low_scale * (256 * hi + lo)
    float sum;        // low_scale * the block's sum of 256 * hi + lo: for int4's min term
    int32_t offset;   // 128 * the block's sum of 256 * hi + lo: int8's +128 bias on q
    int32_t first_half;  // the sum of 256 * hi + lo over inputs 0-15: int6k's -32 on q, per 16 inputs
};

// int6k's x term of one half (16 inputs) of an x block: 32 * its digit sum (q - 32 = the stored q, less 32)
inline int32_t int6k_offset(const XBlockTerms& x, int half) {
    return 32 * (half == 0 ? x.first_half : x.offset / 128 - x.first_half);
}


// acc + the int32 sums of one x block (256 * high + low digit), times the weight scale (+ int4's min term)
template <Format F>
Vec add_x_block(const XBlockTerms& x, IVec total, Vec scale, Vec minimum, Vec acc) {
    const Vec combined = Vec::mul(scale, Vec::broadcast(x.low_scale));
    acc = Vec::fma(total.to_float(F == kInt8 ? x.offset : 0), combined, acc);
    if constexpr (F == kInt4) acc = Vec::fma(Vec::broadcast(x.sum), minimum, acc);
    return acc;
}

// acc + int6k's int32 sums of one half (16 inputs) of an x block, times that half's weight scale
inline Vec add_int6k_half(const XBlockTerms& x, int half, IVec total, Vec scale, Vec acc) {
    return Vec::fma(total.to_float(int6k_offset(x, half)), Vec::mul(scale, Vec::broadcast(x.low_scale)), acc);
}

struct Problem {
    const float* x;         // bf16 format: [rows][Kp] float32
    const int8_t* xq_high;  // int formats: [rows][Kp] x quantized per block of 32, the high digits ...
    const int8_t* xq_low;   // ... and [rows][Kp] the low ones
    const int16_t* xq_wide;  // AVX2: [rows][Kp] both as one, 256 * high + low
    const int8_t* x_tiles;   // AMX: both digits as its tiles read them (tile_digits), or null
    const XBlockTerms* x_terms;  // [rows][Kp/32]
    const int8_t* x_panel;       // the int formats' vector passes off AVX2: x as they read it (kPanelRows)
    const XBlockTerms* terms_panel;  // ... and its terms
    int64_t rows, K, Kp, N, group, groups;
    const void* packed;
    const uint16_t* scales;
    const uint16_t* mins;
    const float* bias;  // [N] or null
};

// int4k: group g's scale d * sc and minimum -dmin * m per lane (both exact in float32)
inline void int4k_scales(const Problem& p, int64_t block, int64_t g, Vec& scale, Vec& minimum) {
    const uint8_t* super = reinterpret_cast<const uint8_t*>(p.scales) +
                           (block * (p.groups / kSuperGroups) + g / kSuperGroups) * kInt4KSuperBytes;
    const int64_t j = g % kSuperGroups;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(super + 2 * kSuperGroups * kLanes);
    scale = Vec::mul(Vec::load_u8(super + j * kLanes), Vec::load_f16(d));
    minimum = Vec::mul(Vec::load_u8(super + (kSuperGroups + j) * kLanes),
                       Vec::mul(Vec::load_f16(d + kLanes), Vec::broadcast(-1.f)));
}

// int6k: the scale d * sc of half `half` (16 inputs) of group g per lane
inline Vec int6k_scale(const Problem& p, int64_t block, int64_t g, int half) {
    const uint8_t* super = reinterpret_cast<const uint8_t*>(p.scales) +
                           (block * (p.groups / kSuperGroups) + g / kSuperGroups) * kInt6KSuperBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(super) + ((g % kSuperGroups) * 2 + half) * kLanes;
    return Vec::mul(Vec::load_i8(sc), Vec::load_f16(reinterpret_cast<const uint16_t*>(super + 2 * kSuperGroups * kLanes)));
}

// x's digits and terms as the vector passes read them off AVX2 (x_panel): per kPanelRows rows and x block, each row's
// 32 high digits then its 32 low ones, or both as 32 int16 (int6k on VNNI, in x_wide's order), [passes][Kp/32][kPanelRows][64 bytes], and
// the terms the same way. A pass's rows sit at fixed offsets from one pointer: read from the [rows][Kp] planes, every
// row took its own address arithmetic, and GCC spilled the pointers (2-core EPYC Zen 4: a 1B's 16384x2048 int4k
// linear 4-8% faster at 8 to 256 rows). The passes of block_sums start at multiples of kPanelRows.
constexpr int64_t kPanelRows = 8;
constexpr int64_t kPanelEntryBytes = 2 * kXBlock;
// The panel entry of row `row`'s x block xb, of x_blocks (Kp / 32) a row: quantize_rows writes it, the passes read it
inline int64_t x_panel_index(int64_t row, int64_t x_blocks, int64_t xb) {
    return ((row / kPanelRows) * x_blocks + xb) * kPanelRows + row % kPanelRows;
}
inline const int8_t* x_panel_entry(const Problem& p, int64_t row, int m, int64_t xb) {
    return p.x_panel + (x_panel_index(row, p.Kp / kXBlock, xb) + m) * kPanelEntryBytes;
}
// Where input `within` of an x block sits in int6k's joined digits on VNNI: each 4 in the order int6k_pairs' pairs
// take them, 0, 2, 1, 3
constexpr int x_wide_order(int within) { return within / 4 * 4 + within % 2 * 2 + within % 4 / 2; }

#if defined(TOKENMILL_AVX2_INT)
constexpr bool kWideX = true;
// Row `row + m`'s digits of inputs within..within+3 of x block xb, and its terms
XPairs x_digits(const Problem& p, int64_t row, int m, int64_t xb, int within) {
    const int16_t* at = p.xq_wide + (row + m) * p.Kp + xb * kXBlock + within;
    int32_t first_pair, second_pair;
    std::memcpy(&first_pair, at, sizeof(first_pair));
    std::memcpy(&second_pair, at + 2, sizeof(second_pair));
    return {_mm256_set1_epi32(first_pair), _mm256_set1_epi32(second_pair)};
}
inline const XBlockTerms& x_block_terms(const Problem& p, int64_t row, int m, int64_t xb) {
    return p.x_terms[(row + m) * (p.Kp / kXBlock) + xb];
}
#else
constexpr bool kWideX = false;
// The high and the low digit's sums apart, combined once per x block
struct XDigits {
    decltype(IVec::quad(nullptr)) high, low;
};
XDigits x_digits(const Problem& p, int64_t row, int m, int64_t xb, int within) {
    const int8_t* at = x_panel_entry(p, row, m, xb) + within;
    return {IVec::quad(at), IVec::quad(at + kXBlock)};
}
inline const XBlockTerms& x_block_terms(const Problem& p, int64_t row, int m, int64_t xb) {
    return p.terms_panel[x_panel_index(row, p.Kp / kXBlock, xb) + m];
}
template <typename Bytes>
Bytes widened(Bytes w) {
    return w;
}
struct DigitSums {
    IVec high, low;
    static DigitSums zero() { return {IVec::zero(), IVec::zero()}; }
    template <typename Bytes>
    void dot(const Bytes& w, const XDigits& x) {
        high.dot(w, x.high);
        low.dot(w, x.low);
    }
    IVec total() const { return IVec::combine(high, low); }
};
#endif

// Rows of x per pass over a block. VNNI: eight rows of one block, 8 x 2 digit sums + 8 float sums in registers. Four
// rows of two blocks side by side hold as many, but rebuild each block's nibbles and group scales for every four
// rows, and at 8 rows read two blocks' weights from memory at once (2-core EPYC Zen 4, the 1B's 16384x2048 int4k
// linear: 1.15x at 8 rows, 1.03x at 256; the same bits). AVX2's sums take two ymm a row beside four of widened
// weights: four rows, one block at a time (five measured the same in L1). Divides kPanelRows.
#if defined(TOKENMILL_VNNI)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif
static_assert(kPanelRows % kMaxRows == 0, "a pass's rows are in one x panel pass");

// int6k: a group's six cache lines ahead, one per chunk of its first half and two in its second. The high bits'
// lines are a third of the stream: with only the nibbles' four prefetched, Q6_K 2048x8192 linears read 20.2-21.4 GB/s
// at one row beside Q4_K's 23.5-25.3 (2-core Xeon); with all six and two sum chains (int6k_block_sums) 22.2-22.8.
inline void int6k_prefetch(const uint8_t* group_bytes, int half, int c) {
    const int line = 4 * half + c;
    if (line < kInt6KGroupBytes / 64) __builtin_prefetch(group_bytes + 64 * line + kPrefetchAhead);
}

// int6k: the codes (0..63) of chunk c of a group's half, inputs 16 * half + 4c + j of each lane, from the group's
// bytes and that half's high bit pairs
template <typename Bytes>
inline Bytes int6k_codes(const uint8_t* group_bytes, const Bytes& high, int half, int c) {
    const Bytes packed = IVec::load(group_bytes + 64 * c);
    return IVec::six_bits(half == 0 ? IVec::low_nibbles(packed) : IVec::high_nibbles(packed), high, c);
}

#if defined(TOKENMILL_AVX2_INT)
// int6k's one row on AVX2, one group, as one_row_nibble_sums does int4's: a pair sum of six-bit codes is at most
// 2 * 63 * 128 = 16128, so two chunks' add up in int16 before they widen. Half 0's sums, then half 1's. A 2048x2048
// Q6_K linear from L3 on one thread 1.1x as fast (14.7 against 13.1-13.4 GB/s; Zen 4 without AVX-512, alternated).
inline void one_row_int6k_sums(const uint8_t* group_bytes, const int8_t* high, const int8_t* low,
                               IVec (&totals)[2]) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
        const Bytes64 high_bits = IVec::load(group_bytes + 256 + 64 * half);
        totals[half] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 2
        for (int pair = 0; pair < 2; ++pair) {
            ByteDigitSums sums = ByteDigitSums::zero();
#pragma GCC unroll 2
            for (int c = 2 * pair; c < 2 * pair + 2; ++c) {
                int6k_prefetch(group_bytes, half, c);
                const int within = 16 * half + 4 * c;
                sums.add(int6k_codes(group_bytes, high_bits, half, c), high + within, low + within);
            }
            const IVec two_chunks = sums.total();
            totals[half] = {_mm256_add_epi32(totals[half].a, two_chunks.a),
                            _mm256_add_epi32(totals[half].b, two_chunks.b)};
        }
    }
}
#endif

// Sums of MT rows against NB consecutive blocks (16 outputs each), one group (or all of K for bf16) at a time,
// into result[(b * MT + m) * kLanes + lane].
// One block at a time (NB = 1) while the weights stream from memory: a block's weights are one contiguous run,
// so a thread's work (consecutive blocks) reads as a single sequential stream, which the prefetchers follow;
// two or four blocks read side by side were as many interleaved streams, and a decode step's matmuls ran ~20%
// slower at 1 to 8 rows (2-core EPYC, bench/qlinear_bench.py), with the same bits. With many rows the weights
// come from cache and the arithmetic bounds: two blocks side by side use each broadcast digit of x twice
// (1.1-1.2x at 8 to 2048 rows for int4 and int8 against one block of 4 rows, same bits; the loops over c and q must
// be unrolled, or GCC keeps the [NB][MT] sums in memory and it ran 0.75x). On VNNI one block of 8 rows does better
// still (kMaxRows): a broadcast digit costs a load, not a multiply.
#if defined(TOKENMILL_VNNI)
// int6k on VNNI: each chunk's codes less 32 as int16 pairs (int6k_pairs), multiplied with x's two digits as one
// int16 (256 * high + low) by vpdpwssd. As many dot instructions as int8's two digit passes
// (a pair of inputs in one, against four inputs in one of two), and the epilogue of each 16 inputs is a convert
// and an FMA: with vpdpbusd, two digit sums to combine and a -32 term per 16 inputs made int6k 1.55-1.6x int8's
// time from 4 rows. Exact in int32: a lane's 16 products are at most 16 * 32 * 32640 = 1.7e7.
constexpr bool kWideInt6K = true;
// Rows per pass over a block: a chunk's pairs are rebuilt (8 instructions) for each pass, against 2 dot
// instructions per row, so a pass takes as many rows as the registers hold: 8 rows' int32 and float sums.
constexpr int kInt6KRows = 8;

// Row `row + m`'s x block xb as 32 int16, 256 * high + low: x_panel's form for int6k on VNNI (x_wide_order)
inline const int16_t* x_wide(const Problem& p, int64_t row, int m, int64_t xb) {
    return reinterpret_cast<const int16_t*>(x_panel_entry(p, row, m, xb));
}

// Chunk c of a group's half as int16 pairs, inputs 4c + {0, 2} and 4c + {1, 3} of each lane, less 32: each code's
// byte masked to, or shifted into, the low half of its int16. With a byte shuffle into inputs {0, 1} and {2, 3}, int6k
// ran 0.87-0.91x as fast at 8 rows and 0.93x at 64 (2-core EPYC Zen 4, a 2048x8192 linear; the same int32 sums).
inline void int6k_pairs(const uint8_t* group_bytes, __m512i high, int half, int c, __m512i (&pairs)[2]) {
    const __m512i bytes = int6k_codes(group_bytes, high, half, c);
    const __m512i bias = _mm512_set1_epi16(32);
    pairs[0] = _mm512_sub_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0xff)), bias);
    pairs[1] = _mm512_sub_epi16(_mm512_srli_epi16(bytes, 8), bias);
}

// int6k's pairs of NB blocks, [NB][groups][half][c][2][64 bytes], for many rows: built once per block
template <int NB>
void decode_int6k_pairs(const Problem& p, int64_t block, int16_t* out) {
    const uint8_t* bytes = static_cast<const uint8_t*>(p.packed);
    for (int b = 0; b < NB; ++b)
        for (int64_t g = 0; g < p.groups; ++g) {
            const uint8_t* at = bytes + ((block + b) * p.groups + g) * kInt6KGroupBytes;
            for (int half = 0; half < 2; ++half) {
                const __m512i high = _mm512_loadu_si512(at + 256 + 64 * half);
                for (int c = 0; c < 4; ++c) {
                    __m512i pairs[2];
                    int6k_pairs(at, high, half, c, pairs);
                    int16_t* to = out + (((b * p.groups + g) * 2 + half) * 4 + c) * 64;
                    _mm512_storeu_si512(to, pairs[0]);
                    _mm512_storeu_si512(to + 32, pairs[1]);
                }
            }
        }
}

template <int MT, int NB>
void int6k_block_sums(const Problem& p, int64_t block, int64_t row, float* result, const int16_t* decoded) {
    Vec acc[NB][MT];
    for (auto& sums : acc)
        for (Vec& sum : sums) sum = Vec::zero();
    const uint8_t* bytes = static_cast<const uint8_t*>(p.packed);
    for (int64_t g = 0; g < p.groups; ++g) {
        for (int half = 0; half < 2; ++half) {
            // [chain][block][row]: at one row, even and odd chunks sum apart (an int32 add joins them, exactly), so the
            // eight dependent vpdpwssd of a half are two chains of four
            constexpr int chains = MT == 1 ? 2 : 1;
            __m512i sums[chains][NB][MT];
            for (auto& chain : sums)
                for (auto& row_sums : chain)
                    for (__m512i& sum : row_sums) sum = _mm512_setzero_si512();
            __m512i high[NB];
            if (decoded == nullptr)
                for (int b = 0; b < NB; ++b)
                    high[b] = _mm512_loadu_si512(bytes + ((block + b) * p.groups + g) * kInt6KGroupBytes + 256 + 64 * half);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                __m512i w[NB][2];
                for (int b = 0; b < NB; ++b) {
                    if (decoded != nullptr) {
                        const int16_t* at = decoded + (((b * p.groups + g) * 2 + half) * 4 + c) * 64;
                        w[b][0] = _mm512_loadu_si512(at);
                        w[b][1] = _mm512_loadu_si512(at + 32);
                    } else {
                        const uint8_t* at = bytes + ((block + b) * p.groups + g) * kInt6KGroupBytes;
                        int6k_prefetch(at, half, c);
                        int6k_pairs(at, high[b], half, c, w[b]);
                    }
                }
                for (int m = 0; m < MT; ++m) {
                    const int16_t* x = x_wide(p, row, m, g) + 16 * half + 4 * c;
                    int32_t first_pair, second_pair;
                    std::memcpy(&first_pair, x, sizeof(first_pair));
                    std::memcpy(&second_pair, x + 2, sizeof(second_pair));
                    const __m512i x01 = _mm512_set1_epi32(first_pair), x23 = _mm512_set1_epi32(second_pair);
                    for (int b = 0; b < NB; ++b) {
                        __m512i& sum = sums[c % chains][b][m];
                        sum = _mm512_dpwssd_epi32(sum, w[b][0], x01);
                        sum = _mm512_dpwssd_epi32(sum, w[b][1], x23);
                    }
                }
            }
            for (int b = 0; b < NB; ++b) {
                const Vec scale = int6k_scale(p, block + b, g, half);
                for (int m = 0; m < MT; ++m) {
                    const float low_scale = x_block_terms(p, row, m, g).low_scale;
                    __m512i total = sums[0][b][m];
                    if constexpr (chains == 2) total = _mm512_add_epi32(total, sums[1][b][m]);
                    acc[b][m] = Vec::fma(Vec{_mm512_cvtepi32_ps(total)}, Vec::mul(scale, Vec::broadcast(low_scale)),
                                         acc[b][m]);
                }
            }
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int m = 0; m < MT; ++m) acc[b][m].store(result + (b * MT + m) * kLanes);
}
#else
constexpr bool kWideInt6K = false;
#endif

// int6k's codes of NB blocks as whole bytes, [NB][groups][half][c][16 lanes][4] (512 bytes a block and group), on
// builds without VNNI (VNNI builds int16 pairs, decode_int6k_pairs): with many rows each 4-row pass over a block
// would rebuild them from nibbles and bit pairs; built once per block, the passes read bytes, as int8's do.
template <int NB>
void decode_int6k(const Problem& p, int64_t block, uint8_t* out) {
    const uint8_t* bytes = static_cast<const uint8_t*>(p.packed);
    for (int b = 0; b < NB; ++b)
        for (int64_t g = 0; g < p.groups; ++g) {
            const uint8_t* at = bytes + ((block + b) * p.groups + g) * kInt6KGroupBytes;
            uint8_t* to = out + (b * p.groups + g) * 512;
            for (int half = 0; half < 2; ++half) {
                const auto high = IVec::load(at + 256 + 64 * half);
                for (int c = 0; c < 4; ++c) IVec::store(int6k_codes(at, high, half, c), to + (half * 4 + c) * 64);
            }
        }
}

// kDecoded (int6k only): `decoded` holds decode_int6k's codes of these blocks
template <Format F, int MT, int NB = 1, bool kDecoded = false>
void block_sums(const Problem& p, int64_t block, int64_t row, float* result, const uint8_t* decoded = nullptr) {
    Vec acc[NB][MT];
    for (auto& sums : acc)
        for (Vec& sum : sums) sum = Vec::zero();
    const int64_t groups = F == kBf16 ? 1 : p.groups;
    const int64_t group = F == kBf16 ? p.Kp : p.group;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * group, k1 = k0 + group;
        if constexpr (F == kBf16) {
            static_assert(NB == 1, "bf16 runs one block at a time");
            for (int64_t k = k0; k < k1; ++k) {
                const Vec w = Vec::load_bf16(static_cast<const uint16_t*>(p.packed) + (block * p.Kp + k) * kLanes);
                for (int m = 0; m < MT; ++m)
                    acc[0][m] = Vec::fma(Vec::broadcast(p.x[(row + m) * p.Kp + k]), w, acc[0][m]);
            }
        } else {
            // one x block (32 inputs) at a time; for int4 a group is one x block
            const uint8_t* bytes = static_cast<const uint8_t*>(p.packed);
            for (int64_t xb = k0 / kXBlock; xb < k1 / kXBlock; ++xb) {
                DigitSums sums[NB][MT];
                for (auto& row_sums : sums)
                    for (DigitSums& sum : row_sums) sum = DigitSums::zero();
                if constexpr (F == kInt8) {
#pragma GCC unroll 8
                    for (int q = 0; q < kXBlock / 4; ++q) {
                        decltype(widened(IVec::load(bytes))) w[NB];
                        for (int b = 0; b < NB; ++b) {
                            const uint8_t* at = bytes + ((block + b) * (p.Kp / 4) + xb * 8 + q) * 64;
                            __builtin_prefetch(at + kPrefetchAhead);
                            w[b] = widened(IVec::load(at));
                        }
                        for (int m = 0; m < MT; ++m) {
                            const auto x = x_digits(p, row, m, xb, 4 * q);
                            for (int b = 0; b < NB; ++b) sums[b][m].dot(w[b], x);
                        }
                    }
                } else if constexpr (F == kInt6K) {
#if defined(TOKENMILL_AVX2_INT)
                    if constexpr (MT == 1 && NB == 1 && !kDecoded) {  // (a last row past 128 reads the codes below)
                        IVec totals[2];
                        one_row_int6k_sums(bytes + (block * p.groups + xb) * kInt6KGroupBytes,
                                           p.xq_high + row * p.Kp + xb * kXBlock,
                                           p.xq_low + row * p.Kp + xb * kXBlock, totals);
                        const XBlockTerms& x = x_block_terms(p, row, 0, xb);
                        for (int half = 0; half < 2; ++half)
                            acc[0][0] = add_int6k_half(x, half, totals[half], int6k_scale(p, block, xb, half),
                                                       acc[0][0]);
                        continue;
                    }
#endif
                    // half 0 (inputs 0-15: the low nibbles) to its own scale, then half 1 (the high nibbles).
                    // Both halves unrolled and the decoded codes' branch taken at compile time (kDecoded): with
                    // a loop over the halves and a test of `decoded` per chunk, AVX2's int6k ran 1.2-1.45x
                    // int4k's time per weight and row (2-core EPYC Zen 3, one thread, a 2048x8192 Q6_K linear:
                    // 8 rows 4.4-4.8 -> 3.7-4.1 ms, 256 rows 121-129 -> 107-113 ms; the same bits).
#pragma GCC unroll 2
                    for (int half = 0; half < 2; ++half) {
                        if (half == 1) {
                            for (auto& row_sums : sums)
                                for (DigitSums& sum : row_sums) sum = DigitSums::zero();
                        }
                        decltype(IVec::load(bytes)) high[NB];
                        if constexpr (!kDecoded)
                            for (int b = 0; b < NB; ++b)
                                high[b] = IVec::load(bytes + ((block + b) * p.groups + xb) * kInt6KGroupBytes + 256 + 64 * half);
#pragma GCC unroll 4
                        for (int c = 0; c < 4; ++c) {
                            decltype(widened(IVec::load(bytes))) w[NB];
                            for (int b = 0; b < NB; ++b) {
                                if constexpr (kDecoded) {  // decode_int6k's bytes
                                    w[b] = widened(IVec::load(decoded + ((b * p.groups + xb) * 8 + half * 4 + c) * 64));
                                    continue;
                                }
                                const uint8_t* at = bytes + ((block + b) * p.groups + xb) * kInt6KGroupBytes;
                                int6k_prefetch(at, half, c);
                                w[b] = widened(int6k_codes(at, high[b], half, c));
                            }
                            for (int m = 0; m < MT; ++m) {
                                const auto digits = x_digits(p, row, m, xb, 4 * c + 16 * half);
                                for (int b = 0; b < NB; ++b) sums[b][m].dot(w[b], digits);
                            }
                        }
                        for (int b = 0; b < NB; ++b) {
                            const Vec scale = int6k_scale(p, block + b, xb, half);
                            for (int m = 0; m < MT; ++m) {
                                acc[b][m] = add_int6k_half(x_block_terms(p, row, m, xb), half, sums[b][m].total(),
                                                           scale, acc[b][m]);
                            }
                        }
                    }
                    continue;  // the epilogue is done, per half
#if defined(TOKENMILL_AVX2_INT)
                } else if constexpr (MT == 1 && NB == 1) {
                    const IVec total = one_row_nibble_sums(bytes + (block * (p.Kp / kXBlock) + xb) * 4 * 64,
                                                           p.xq_high + row * p.Kp + xb * kXBlock,
                                                           p.xq_low + row * p.Kp + xb * kXBlock);
                    sums[0][0] = {total.a, total.b};
#endif
                } else {
#pragma GCC unroll 4
                    for (int c = 0; c < 4; ++c) {
                        decltype(IVec::load(bytes)) packed[NB];
                        for (int b = 0; b < NB; ++b) {
                            const uint8_t* at = bytes + (((block + b) * (p.Kp / kXBlock) + xb) * 4 + c) * 64;
                            __builtin_prefetch(at + kPrefetchAhead);
                            packed[b] = IVec::load(at);
                        }
                        // the low nibbles against inputs 4c..4c+3, then the high ones against 16 further: AVX2
                        // holds one half's widened weights at a time (four ymm, not eight, beside two rows' sums)
                        for (int half = 0; half < 2; ++half) {
                            decltype(widened(packed[0])) w[NB];
                            for (int b = 0; b < NB; ++b)
                                w[b] = widened(half == 0 ? IVec::low_nibbles(packed[b])
                                                         : IVec::high_nibbles(packed[b]));
                            for (int m = 0; m < MT; ++m) {
                                const auto digits = x_digits(p, row, m, xb, 4 * c + 16 * half);
                                for (int b = 0; b < NB; ++b) sums[b][m].dot(w[b], digits);
                            }
                        }
                    }
                }
                for (int b = 0; b < NB; ++b) {
                    Vec scale, minimum = Vec::zero();
                    if constexpr (F == kInt4K) {
                        int4k_scales(p, block + b, g, scale, minimum);
                    } else {
                        const int64_t at = ((block + b) * p.groups + g) * kLanes;
                        scale = Vec::load_f16(p.scales + at);
                        if constexpr (F == kInt4) minimum = Vec::load_f16(p.mins + at);
                    }
                    constexpr Format sums_as = F == kInt4K ? kInt4 : F;  // int4k's sums are int4's
                    for (int m = 0; m < MT; ++m)
                        acc[b][m] = add_x_block<sums_as>(x_block_terms(p, row, m, xb),
                                                         sums[b][m].total(), scale, minimum, acc[b][m]);
                }
            }
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int m = 0; m < MT; ++m) acc[b][m].store(result + (b * MT + m) * kLanes);
}

template <typename T>
void write_rows(const Problem& p, int64_t row, int rows, int64_t first_n, const float* result, T* out) {
    const int64_t width = std::min<int64_t>(kLanes, p.N - first_n);
    for (int m = 0; m < rows; ++m) {
        T* out_row = out + (row + m) * p.N + first_n;
        for (int64_t i = 0; i < width; ++i) {
            const float bias = p.bias != nullptr ? p.bias[first_n + i] : 0.f;
            tokenmill::store(result[m * kLanes + i] + bias, out_row + i);
        }
    }
}

// `count` consecutive blocks, each against every row of x, up to kMaxRows rows at a time: a block's weights
// are read from memory by the first rows and from L1 by the rest. From kPairRows rows (where pairs measured
// faster; below, the weights stream from memory and one block at a time reads them best), two blocks at a time:
// only the portable build, whose passes are four rows (VNNI's eight rows of one block hold as many sums).
#if defined(TOKENMILL_VNNI)
constexpr int64_t kPairRows = INT64_MAX;
#else
constexpr int64_t kPairRows = kWideX ? INT64_MAX : 8;
#endif

// From this many rows int6k decodes a block's codes once (decode_int6k, decode_int6k_pairs); below, each pass
// rebuilds them in registers: writing and re-reading a block's decoded codes (256 KB at K = 8192) ran 1.2-1.3x
// slower from 16 to 64 rows, and gained only from ~256 (2-core Xeon, the same bits).
constexpr int64_t kDecodeRows = 128;

// One pass of `rows` (<= kMaxRows) rows over NB blocks, into `result`
template <Format F, int NB, bool kDecoded>
void pass_sums(const Problem& p, int64_t block, int64_t row, int rows, float* result, const uint8_t* decoded) {
    switch (rows) {
#if defined(TOKENMILL_VNNI)
        case 8: block_sums<F, 8, NB, kDecoded>(p, block, row, result, decoded); break;
        case 7: block_sums<F, 7, NB, kDecoded>(p, block, row, result, decoded); break;
        case 6: block_sums<F, 6, NB, kDecoded>(p, block, row, result, decoded); break;
        case 5: block_sums<F, 5, NB, kDecoded>(p, block, row, result, decoded); break;
#endif
        case 4: block_sums<F, 4, NB, kDecoded>(p, block, row, result, decoded); break;
        case 3: block_sums<F, 3, NB, kDecoded>(p, block, row, result, decoded); break;
        case 2: block_sums<F, 2, NB, kDecoded>(p, block, row, result, decoded); break;
        default: block_sums<F, 1, NB, kDecoded>(p, block, row, result, decoded); break;
    }
}

template <Format F, int NB, typename T>
void run_rows(const Problem& p, int64_t block, T* out) {
    alignas(64) float result[NB * kMaxRows * kLanes];
#if defined(TOKENMILL_VNNI)
    if constexpr (F == kInt6K) {
        const int16_t* pairs = nullptr;
        if (p.rows >= kDecodeRows) {  // more passes than one over the block: its pairs built once
            static thread_local std::vector<int16_t> scratch;
            scratch.resize(static_cast<size_t>(NB * p.groups * 2 * 4 * 64));
            decode_int6k_pairs<NB>(p, block, scratch.data());
            pairs = scratch.data();
        }
        static_assert(NB == 1, "int6k runs one block at a time (run_blocks)");
        alignas(64) float sums[kInt6KRows * kLanes];
        for (int64_t row = 0; row < p.rows; row += kInt6KRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kInt6KRows, p.rows - row));
            switch (rows) {
                case 8: int6k_block_sums<8, 1>(p, block, row, sums, pairs); break;
                case 7: int6k_block_sums<7, 1>(p, block, row, sums, pairs); break;
                case 6: int6k_block_sums<6, 1>(p, block, row, sums, pairs); break;
                case 5: int6k_block_sums<5, 1>(p, block, row, sums, pairs); break;
                case 4: int6k_block_sums<4, 1>(p, block, row, sums, pairs); break;
                case 3: int6k_block_sums<3, 1>(p, block, row, sums, pairs); break;
                case 2: int6k_block_sums<2, 1>(p, block, row, sums, pairs); break;
                default: int6k_block_sums<1, 1>(p, block, row, sums, pairs); break;
            }
            write_rows(p, row, rows, block * kLanes, sums, out);
        }
        return;
    }
#endif
    const uint8_t* decoded = nullptr;
    if constexpr (F == kInt6K) {
        if (p.rows >= kDecodeRows) {
            static thread_local std::vector<uint8_t> scratch;
            scratch.resize(static_cast<size_t>(NB * p.groups * 512));
            decode_int6k<NB>(p, block, scratch.data());
            decoded = scratch.data();
        }
    }
    for (int64_t row = 0; row < p.rows; row += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, p.rows - row));
        if constexpr (F == kInt6K) {
            if (decoded != nullptr)
                pass_sums<F, NB, true>(p, block, row, rows, result, decoded);
            else
                pass_sums<F, NB, false>(p, block, row, rows, result, nullptr);
        } else {
            pass_sums<F, NB, false>(p, block, row, rows, result, nullptr);
        }
        for (int b = 0; b < NB; ++b)
            write_rows(p, row, rows, (block + b) * kLanes, result + b * rows * kLanes, out);
    }
}

#if defined(TOKENMILL_AMX)
// The kernel hands out AMX's tile state per process on request (Linux's arch_prctl). Some VMs list AMX in the CPU
// flags without enabling it, where a tile instruction dies with SIGILL: the first use asks for the state, then
// runs one tile product in a forked child, and only where both succeed do the int4k / int6k kernels use the tiles.
constexpr long kRequestTilePermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileDataFeature = 18;            // XFEATURE_XTILEDATA

struct TileConfig {  // ldtilecfg's 64 bytes, palette 1
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

// Tiles: 0 and 1 the digits of 8 rows of x [16: the rows' high digits, then their low ones][k_bytes] for two spans
// of inputs; 2 and 3 the weights of two blocks [k_bytes / 4][16 lanes x 4]; 4-7 the int32 sums [16][16 lanes] of
// each block and span.
void configure_tiles(int k_bytes) {
    TileConfig config;
    for (int t : {0, 1}) config.bytes_per_row[t] = static_cast<uint16_t>(k_bytes), config.rows[t] = 16;
    for (int t : {2, 3}) config.bytes_per_row[t] = 64, config.rows[t] = static_cast<uint8_t>(k_bytes / 4);
    for (int t : {4, 5, 6, 7}) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, and it dropped the stores of the rest
    asm volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

bool tile_product_runs() {
    // The bare system call, not fork(): no atfork handlers (torch's, OpenMP's) run for a child that only probes
    const long child = syscall(SYS_fork);
    if (child < 0) return false;
    if (child == 0) {  // only system calls and the tile instructions here: the parent may have threads
        if (syscall(SYS_arch_prctl, kRequestTilePermission, kTileDataFeature) != 0) _exit(1);
        alignas(64) int8_t a[16 * 64] = {};
        alignas(64) int32_t c[16 * 16];
        configure_tiles(32);
        _tile_loadd(0, a, 32);
        _tile_loadd(2, a, 64);
        _tile_zero(4);
        _tile_dpbsud(4, 0, 2);
        _tile_stored(4, c, 64);
        _tile_release();
        _exit(c[0] == 0 ? 0 : 1);
    }
    int status = 0;
    while (waitpid(static_cast<pid_t>(child), &status, 0) < 0)
        if (errno != EINTR) return false;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool amx_usable() {
    static const bool usable =
        tile_product_runs() && syscall(SYS_arch_prctl, kRequestTilePermission, kTileDataFeature) == 0;
    return usable;
}
std::atomic<bool> amx_enabled{true};  // tokenmill_qlinear_amx: the vpdpbusd path on request (tests compare both)

// From this many rows the K-quant kernels run on AMX. Below, a tile product (16 digit rows) is mostly empty, and
// at one row vpdpbusd reads each weight once without the round trip through a tile buffer.
constexpr int64_t kAmxRows = 8;
constexpr int kAmxTileRows = 8;  // rows of x per tile product: their high and low digits fill its 16 rows
constexpr int kAmxBlocks = kTileBlocks / 2;  // blocks per pass: qlinear's unit of work, half a tile
static_assert(kAmxBlocks == 2, "the products load the two blocks' weights into tiles 2 and 3");
constexpr int64_t kAmxGroupBytes = 512;  // a group's weights as tiles, or 8 rows' digits: 32 inputs, a byte each

bool amx_rows(int format, int64_t rows) {
    return (format == kInt4K || format == kInt6K) && rows >= kAmxRows && amx_enabled.load(std::memory_order_relaxed) &&
           amx_usable();
}

// x's digits as the tiles read them, [rows / 8][groups][16][32]: per 8 rows and group of 32 inputs, the rows' high
// digits, then their low ones, each row's 32 contiguous (rows past the last are zero).
void tile_digits(const int8_t* high, const int8_t* low, int64_t rows, int64_t Kp, int8_t* out, int threads) {
    const int64_t groups = Kp / kXBlock, tiles = (rows + kAmxTileRows - 1) / kAmxTileRows;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int64_t tile = 0; tile < tiles; ++tile)
        for (int64_t g = 0; g < groups; ++g) {
            int8_t* to = out + (tile * groups + g) * kAmxGroupBytes;
            for (int r = 0; r < kAmxTileRows; ++r) {
                const int64_t row = tile * kAmxTileRows + r;
                int8_t* high_to = to + r * kXBlock;
                int8_t* low_to = to + (kAmxTileRows + r) * kXBlock;
                if (row < rows) {
                    std::memcpy(high_to, high + row * Kp + g * kXBlock, kXBlock);
                    std::memcpy(low_to, low + row * Kp + g * kXBlock, kXBlock);
                } else {
                    std::memset(high_to, 0, kXBlock);
                    std::memset(low_to, 0, kXBlock);
                }
            }
        }
}

// Group g of a block as tile bytes: int4k's codes (0..15; rows 0-3 the low nibbles of chunks 0-3, inputs 0-15,
// rows 4-7 the high ones, 16-31); int6k's codes less 32 (int8), per half of 16 inputs (256 bytes each).
template <Format F>
void amx_weights(const Problem& p, int64_t block, int64_t g, uint8_t* out) {
    const uint8_t* bytes = static_cast<const uint8_t*>(p.packed);
    if constexpr (F == kInt4K) {
        const uint8_t* at = bytes + (block * (p.Kp / kXBlock) + g) * 4 * 64;
        __builtin_prefetch(at + kPrefetchAhead);
        __builtin_prefetch(at + 128 + kPrefetchAhead);
        for (int c = 0; c < 4; ++c) {
            const __m512i packed = IVec::load(at + 64 * c);
            IVec::store(IVec::low_nibbles(packed), out + 64 * c);
            IVec::store(IVec::high_nibbles(packed), out + 64 * (4 + c));
        }
    } else {
        const uint8_t* at = bytes + (block * p.groups + g) * kInt6KGroupBytes;
        for (int line = 0; line < kInt6KGroupBytes; line += 64) __builtin_prefetch(at + line + kPrefetchAhead);
        for (int half = 0; half < 2; ++half) {
            const __m512i high = IVec::load(at + 256 + 64 * half);
            for (int c = 0; c < 4; ++c)
                IVec::store(_mm512_sub_epi8(int6k_codes(at, high, half, c), _mm512_set1_epi8(32)),
                            out + 64 * (4 * half + c));
        }
    }
}

// Two blocks' weights as tile bytes ([NB][groups], as amx_weights writes them) and their scales as floats per span
// ([NB][spans][int4k: scale, minimum | int6k: scale][16 lanes], as int4k_scales / int6k_scale make them), written
// once for all of a step's 8-row passes: otherwise each pass rebuilt both (a scale pair took 9 uops per block and span).
struct AmxDecoded {
    const uint8_t* weights;
    const float* scales;
};

template <Format F>
constexpr int amx_scale_vectors() {
    return F == kInt4K ? 2 : 1;
}

// Sums of MT rows (8-row tile `tile`) against the NB = 2 consecutive blocks of qlinear's unit of work, as
// block_sums' and int6k_block_sums' epilogues make them from the same int32 sums, so the same bits: per scale's span
// (a group; int6k: half a group), one tile product per block gives both digits' sums, then 256 * high + low,
// converted and scaled in float.
// Spans go two at a time on separate tiles (one set of tiles per span, reused span after span, ran 512 rows of a
// 1B's gate_up 0.95x the vector path's time, two sets 0.75x; writing each pair's weights an iteration ahead and
// scaling its sums an iteration behind gained nothing more).
// `decoded`: the blocks decoded beforehand, or null to decode each group's weights and scales as they come.
template <Format F, int MT>
void amx_block_sums(const Problem& p, int64_t block, int64_t tile, float* result, const AmxDecoded* decoded) {
    constexpr int NB = kAmxBlocks;
    Vec acc[NB][MT];
    for (auto& sums : acc)
        for (Vec& sum : sums) sum = Vec::zero();
    alignas(64) int32_t sums[2][NB][2 * kAmxTileRows * kLanes];  // [span of the pair][block][digit row][lane]
    alignas(64) uint8_t weights[NB][kAmxGroupBytes];
    const int64_t row = tile * kAmxTileRows, x_blocks = p.Kp / kXBlock;
    constexpr int parts = F == kInt4K ? 1 : 2;  // int6k's scale spans 16 inputs
    constexpr int64_t part_bytes = kAmxGroupBytes / parts;
    const uint8_t* w[NB] = {};
    // span's products on tiles 0, 4, 5 (`second`: 1, 6, 7); GCC's tile intrinsics take the tile numbers as text
    const auto product = [&](int64_t span, auto second) {
        const int64_t g = span / parts, part = span % parts;
        if (part == 0) {
            for (int b = 0; b < NB; ++b) {
                if (decoded != nullptr) {
                    w[b] = decoded->weights + (b * p.groups + g) * kAmxGroupBytes;
                } else {
                    amx_weights<F>(p, block + b, g, weights[b]);
                    w[b] = weights[b];
                }
            }
        }
        const int8_t* x = p.x_tiles + (tile * p.groups + g) * kAmxGroupBytes + part * (kXBlock / parts);
        _tile_loadd(2, w[0] + part * part_bytes, 64);
        _tile_loadd(3, w[1] + part * part_bytes, 64);
        if constexpr (!decltype(second)::value) {
            _tile_loadd(0, x, kXBlock);
            _tile_zero(4);
            _tile_zero(5);
            if constexpr (F == kInt4K) {
                _tile_dpbsud(4, 0, 2);
                _tile_dpbsud(5, 0, 3);
            } else {
                _tile_dpbssd(4, 0, 2);
                _tile_dpbssd(5, 0, 3);
            }
        } else {
            _tile_loadd(1, x, kXBlock);
            _tile_zero(6);
            _tile_zero(7);
            if constexpr (F == kInt4K) {
                _tile_dpbsud(6, 1, 2);
                _tile_dpbsud(7, 1, 3);
            } else {
                _tile_dpbssd(6, 1, 2);
                _tile_dpbssd(7, 1, 3);
            }
        }
    };
    // 256 * high + low in float: both converts are exact (|sum| < 2^24) and so is the FMA, whose exact result is an
    // integer below 2^24 too (int4k: 32 * 15 * 32640; int6k: 16 * 32 * 32640), so these are the bits the vector
    // path's integer combine and convert give, from the digit sums as the tiles stored them: the epilogue, not the
    // tiles, bounds this loop. Row by row, both blocks: the accumulators, both blocks' scales and one row's x
    // terms stay in registers (blocks outer, GCC held every row's x terms and spilled accumulators).
    const Vec digit_base = Vec::broadcast(static_cast<float>(kDigitBase));
    const auto total = [&](const int32_t* digit_sums, int m) {
        const Vec high = {_mm512_cvtepi32_ps(_mm512_load_si512(digit_sums + m * kLanes))};
        const Vec low = {_mm512_cvtepi32_ps(_mm512_load_si512(digit_sums + (kAmxTileRows + m) * kLanes))};
        return Vec::fma(high, digit_base, low);
    };
    const auto epilogue = [&](int64_t span, const int32_t (&span_sums)[NB][2 * kAmxTileRows * kLanes]) {
        const int64_t g = span / parts, part = span % parts;
        const float* table = decoded != nullptr ? decoded->scales + span * amx_scale_vectors<F>() * kLanes : nullptr;
        if constexpr (F == kInt4K) {  // add_x_block<kInt4>'s arithmetic
            Vec scale[NB], minimum[NB];
            for (int b = 0; b < NB; ++b) {
                if (table != nullptr) {
                    const float* at = table + b * p.groups * parts * amx_scale_vectors<F>() * kLanes;
                    scale[b] = Vec::load(at), minimum[b] = Vec::load(at + kLanes);
                } else {
                    int4k_scales(p, block + b, g, scale[b], minimum[b]);
                }
            }
            for (int m = 0; m < MT; ++m) {
                const XBlockTerms& x = p.x_terms[(row + m) * x_blocks + g];
                const Vec low_scale = Vec::broadcast(x.low_scale), x_sum = Vec::broadcast(x.sum);
                for (int b = 0; b < NB; ++b) {
                    acc[b][m] = Vec::fma(total(span_sums[b], m), Vec::mul(scale[b], low_scale), acc[b][m]);
                    acc[b][m] = Vec::fma(x_sum, minimum[b], acc[b][m]);
                }
            }
        } else {
            Vec scale[NB];
            for (int b = 0; b < NB; ++b)
                scale[b] = table != nullptr ? Vec::load(table + b * p.groups * parts * kLanes)
                                            : int6k_scale(p, block + b, g, static_cast<int>(part));
            for (int m = 0; m < MT; ++m) {
                const Vec low_scale = Vec::broadcast(p.x_terms[(row + m) * x_blocks + g].low_scale);
                for (int b = 0; b < NB; ++b)
                    acc[b][m] = Vec::fma(total(span_sums[b], m), Vec::mul(scale[b], low_scale), acc[b][m]);
            }
        }
    };
    for (int64_t span = 0; span < p.groups * parts; span += 2) {  // groups come in super blocks of 8: even
        product(span, std::false_type{});
        product(span + 1, std::true_type{});
        _tile_stored(4, sums[0][0], 64);
        _tile_stored(5, sums[0][1], 64);
        _tile_stored(6, sums[1][0], 64);
        _tile_stored(7, sums[1][1], 64);
        epilogue(span, sums[0]);
        epilogue(span + 1, sums[1]);
    }
    for (int b = 0; b < NB; ++b)
        for (int m = 0; m < MT; ++m) acc[b][m].store(result + (b * MT + m) * kLanes);
}

// Two blocks against every row of x, 8 rows a pass; with more than one pass the blocks' tile bytes are written once
// (with one pass, each group's as it comes: written first, a 1B's 8-row step took 1.75x as long).
template <Format F, typename T>
void amx_run_rows(const Problem& p, int64_t block, T* out) {
    using Sums = void (*)(const Problem&, int64_t, int64_t, float*, const AmxDecoded*);
    static constexpr Sums kSums[kAmxTileRows] = {
        amx_block_sums<F, 1>, amx_block_sums<F, 2>, amx_block_sums<F, 3>, amx_block_sums<F, 4>,
        amx_block_sums<F, 5>, amx_block_sums<F, 6>, amx_block_sums<F, 7>, amx_block_sums<F, 8>};
    constexpr int NB = kAmxBlocks;
    AmxDecoded blocks{};
    const AmxDecoded* decoded = nullptr;
    if (p.rows > kAmxTileRows) {
        static thread_local std::vector<uint8_t> weights;
        static thread_local std::vector<float> scales;
        constexpr int parts = F == kInt4K ? 1 : 2, vectors = amx_scale_vectors<F>();
        const int64_t spans = p.groups * parts;
        weights.resize(static_cast<size_t>(NB * p.groups * kAmxGroupBytes));
        scales.resize(static_cast<size_t>(NB * spans * vectors * kLanes));
        for (int b = 0; b < NB; ++b) {
            for (int64_t g = 0; g < p.groups; ++g)
                amx_weights<F>(p, block + b, g, weights.data() + (b * p.groups + g) * kAmxGroupBytes);
            for (int64_t span = 0; span < spans; ++span) {
                float* at = scales.data() + (b * spans + span) * vectors * kLanes;
                if constexpr (F == kInt4K) {
                    Vec scale, minimum;
                    int4k_scales(p, block + b, span, scale, minimum);
                    scale.store(at), minimum.store(at + kLanes);
                } else {
                    int6k_scale(p, block + b, span / parts, static_cast<int>(span % parts)).store(at);
                }
            }
        }
        blocks = {weights.data(), scales.data()};
        decoded = &blocks;
    }
    configure_tiles(F == kInt4K ? kXBlock : kXBlock / 2);
    alignas(64) float result[NB * kAmxTileRows * kLanes];
    for (int64_t tile = 0; tile * kAmxTileRows < p.rows; ++tile) {
        const int rows = static_cast<int>(std::min<int64_t>(kAmxTileRows, p.rows - tile * kAmxTileRows));
        kSums[rows - 1](p, block, tile, result, decoded);
        for (int b = 0; b < NB; ++b)
            write_rows(p, tile * kAmxTileRows, rows, (block + b) * kLanes, result + b * rows * kLanes, out);
    }
}
#endif

template <Format F, typename T>
void run_blocks(const Problem& p, int64_t first_block, int64_t count, T* out) {
    int64_t block = first_block;
#if defined(TOKENMILL_AMX)
    if constexpr (F == kInt4K || F == kInt6K) {
        if (p.x_tiles != nullptr) {
            for (; block < first_block + count; block += kAmxBlocks) amx_run_rows<F>(p, block, out);
            return;
        }
    }
#endif
    if constexpr (F != kBf16 && !(F == kInt6K && kWideInt6K)) {
        if (p.rows >= kPairRows)
            for (; block + 2 <= first_block + count; block += 2) run_rows<F, 2>(p, block, out);
    }
    for (; block < first_block + count; ++block) run_rows<F, 1>(p, block, out);
}

template <typename T>
void to_float_rows(const T* x, int64_t rows, int64_t K, int64_t Kp, float* out) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < K; ++k) out[r * Kp + k] = tokenmill::to_float(x[r * K + k]);
        for (int64_t k = K; k < Kp; ++k) out[r * Kp + k] = 0.f;
    }
}

// One row of x per block of 32 as two int8 digits, the high ones in one [rows][Kp] plane and the low in another:
// high = round(x / s), low = round((x - high * s) / (s / 256)) (the difference in one rounding, an FMA), and a
// low of 128 (it is at most 128: |x - high * s| <= s / 2) carried into high as 1, less 256.
// The scalar loop and the AVX-512 one give the same digits (IEEE division and round-to-nearest-even in both).
template <typename T>
void quantize_row_scalar(const T* x, int64_t K, int64_t Kp, int8_t* high_digits, int8_t* low_digits,
                         XBlockTerms* terms) {
    for (int64_t xb = 0; xb < Kp / kXBlock; ++xb) {
        float block[kXBlock];
        float amax = 0.f;
        for (int i = 0; i < kXBlock; ++i) {
            const int64_t k = xb * kXBlock + i;
            block[i] = k < K ? tokenmill::to_float(x[k]) : 0.f;
            amax = std::max(amax, std::fabs(block[i]));
        }
        const float scale = amax / 127.f, low_scale = scale / kDigitBase;
        int32_t sum = 0, first_half = 0;
        for (int i = 0; i < kXBlock; ++i) {
            if (i == kXBlock / 2) first_half = sum;
            int32_t high = 0, low = 0;
            if (scale != 0.f) {
                const float rounded = std::nearbyint(block[i] / scale);
                high = static_cast<int32_t>(rounded);
                low = static_cast<int32_t>(std::nearbyint(std::fma(-rounded, scale, block[i]) / low_scale));
                if (low > 127) high += 1, low -= kDigitBase;
                low = std::max(-128, low);
            }
            high_digits[xb * kXBlock + i] = static_cast<int8_t>(high);
            low_digits[xb * kXBlock + i] = static_cast<int8_t>(low);
            sum += kDigitBase * high + low;
        }
        terms[xb] = {low_scale, low_scale * static_cast<float>(sum), 128 * sum, first_half};
    }
}

#if defined(TOKENMILL_VNNI) && defined(__AVX512VL__)
__m512 load16(const float* x, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, x); }
__m512 load16(const uint16_t* x, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int8_t* high_digits, int8_t* low_digits, XBlockTerms* terms) {
    const auto mask = [K](int64_t k) -> __mmask16 {
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(kLanes, K - k));
        return static_cast<__mmask16>((1u << left) - 1u);
    };
    const __m512 limit = _mm512_set1_ps(127.f), negative_limit = _mm512_set1_ps(-128.f);
    const __m512 one = _mm512_set1_ps(1.f), base = _mm512_set1_ps(static_cast<float>(kDigitBase));
    for (int64_t xb = 0; xb < Kp / kXBlock; ++xb) {
        const int64_t k = xb * kXBlock;
        const __m512 halves[2] = {load16(x + k, mask(k)), load16(x + k + kLanes, mask(k + kLanes))};
        const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(halves[0])),
                                    _mm512_reduce_max_ps(_mm512_abs_ps(halves[1])));
        const float scale = amax / 127.f, low_scale = scale / kDigitBase;
        __m512i sums = _mm512_setzero_si512();
        int32_t first_half = 0;
        for (int half = 0; half < 2; ++half) {
            __m512i high = _mm512_setzero_si512(), low = _mm512_setzero_si512();
            if (scale != 0.f) {
                const __m512 step = _mm512_set1_ps(scale);
                __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(halves[half], step),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512 rest = _mm512_fnmadd_ps(rounded, step, halves[half]);
                __m512 low_rounded = _mm512_roundscale_ps(_mm512_div_ps(rest, _mm512_set1_ps(low_scale)),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __mmask16 carry = _mm512_cmp_ps_mask(low_rounded, limit, _CMP_GT_OQ);
                rounded = _mm512_mask_add_ps(rounded, carry, rounded, one);
                low_rounded = _mm512_mask_sub_ps(low_rounded, carry, low_rounded, base);
                high = _mm512_cvtps_epi32(rounded);
                low = _mm512_cvtps_epi32(_mm512_min_ps(limit, _mm512_max_ps(negative_limit, low_rounded)));
            }
            _mm_storeu_si128(reinterpret_cast<__m128i*>(high_digits + k + half * kLanes), _mm512_cvtepi32_epi8(high));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(low_digits + k + half * kLanes), _mm512_cvtepi32_epi8(low));
            sums = _mm512_add_epi32(sums, _mm512_add_epi32(_mm512_slli_epi32(high, kDigitShift), low));
            if (half == 0) first_half = _mm512_reduce_add_epi32(sums);
        }
        const int32_t sum = _mm512_reduce_add_epi32(sums);
        terms[xb] = {low_scale, low_scale * static_cast<float>(sum), 128 * sum, first_half};
    }
}
#elif defined(TOKENMILL_AVX2_INT)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// 32 int32 in [-128, 127], four ymm, as 32 int8 in order
inline void store_digits(const __m256i (&digits)[4], int8_t* out) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(digits[0], digits[1]),
                                             _mm256_packs_epi32(digits[2], digits[3]));
    // the packs interleave the 128-bit halves: 32-bit groups come out as 0 2 4 6 1 3 5 7
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline int32_t sum8(__m256i sums) {
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    sum4 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 1));
    return _mm_cvtsi128_si32(sum4);
}

// The scalar loop's digits with 8-lane arithmetic: the same IEEE division, round-to-nearest-even and single-
// rounding FMA per input, so the same bits (on AVX2 the scalar loop was 2-3% of a 4-stream server's time).
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int8_t* high_digits, int8_t* low_digits, XBlockTerms* terms) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 limit = _mm256_set1_ps(127.f), negative_limit = _mm256_set1_ps(-128.f);
    const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    const __m256 base = _mm256_set1_ps(static_cast<float>(kDigitBase));
    for (int64_t xb = 0; xb < Kp / kXBlock; ++xb) {
        const int64_t k = xb * kXBlock;
        __m256 values[4];
        if (k + kXBlock <= K) {
            for (int i = 0; i < 4; ++i) values[i] = load8(x + k + 8 * i);
        } else {  // the last block, zero padded
            alignas(32) float block[kXBlock] = {};
            for (int64_t i = k; i < K; ++i) block[i - k] = tokenmill::to_float(x[i]);
            for (int i = 0; i < 4; ++i) values[i] = _mm256_load_ps(block + 8 * i);
        }
        __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, values[0]), _mm256_andnot_ps(sign, values[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, values[2]), _mm256_andnot_ps(sign, values[3])));
        __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
        amax4 = _mm_max_ss(amax4, _mm_shuffle_ps(amax4, amax4, 1));
        const float scale = _mm_cvtss_f32(amax4) / 127.f, low_scale = scale / kDigitBase;
        __m256i high[4], low[4];
        __m256i sums = _mm256_setzero_si256();
        int32_t first_half = 0;
        for (int i = 0; i < 4; ++i) {
            high[i] = low[i] = _mm256_setzero_si256();
            if (scale != 0.f) {
                const __m256 step = _mm256_set1_ps(scale);
                __m256 rounded = _mm256_round_ps(_mm256_div_ps(values[i], step), kRound);
                const __m256 rest = _mm256_fnmadd_ps(rounded, step, values[i]);
                __m256 low_rounded = _mm256_round_ps(_mm256_div_ps(rest, _mm256_set1_ps(low_scale)), kRound);
                const __m256 carry = _mm256_cmp_ps(low_rounded, limit, _CMP_GT_OQ);  // all ones where low is 128
                rounded = _mm256_add_ps(rounded, _mm256_and_ps(carry, one));
                low_rounded = _mm256_sub_ps(low_rounded, _mm256_and_ps(carry, base));
                high[i] = _mm256_cvtps_epi32(rounded);
                low[i] = _mm256_cvtps_epi32(_mm256_min_ps(limit, _mm256_max_ps(negative_limit, low_rounded)));
            }
            sums = _mm256_add_epi32(sums, _mm256_add_epi32(_mm256_slli_epi32(high[i], kDigitShift), low[i]));
            if (i == 1) first_half = sum8(sums);  // inputs 0-15
        }
        store_digits(high, high_digits + k);
        store_digits(low, low_digits + k);
        const int32_t sum = sum8(sums);
        terms[xb] = {low_scale, low_scale * static_cast<float>(sum), 128 * sum, first_half};
    }
}
#else
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int8_t* high_digits, int8_t* low_digits, XBlockTerms* terms) {
    quantize_row_scalar(x, K, Kp, high_digits, low_digits, terms);
}
#endif

// An x block's digits as int6k's 32 int16 on VNNI, kDigitBase * high + low in x_wide_order (a word permute there:
// the plain loop's scattered stores made a 2048x8192 int6k linear at 256 rows 3% slower)
inline void join_wide(const int8_t* high, const int8_t* low, int8_t* out) {
#if defined(TOKENMILL_VNNI)
    const __m512i high_words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)));
    const __m512i low_words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low)));
    const __m512i joined = _mm512_add_epi16(_mm512_slli_epi16(high_words, kDigitShift), low_words);
    // x_wide_order is its own inverse: the word at i comes from x_wide_order(i)
    const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16, 15, 13, 14,
                                           12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(order, joined));
#else
    int16_t joined[kXBlock];
    for (int i = 0; i < kXBlock; ++i) joined[x_wide_order(i)] = static_cast<int16_t>(kDigitBase * high[i] + low[i]);
    std::memcpy(out, joined, sizeof(joined));
#endif
}

// Rows are independent: split across the threads from four rows (from 16, the other thread waited while one
// quantized 8 rows: a 2048x8192 int6k linear at 8 rows 1.06-1.16 -> 0.99-1.06 ms, at 4 rows 5%; 2-core EPYC Zen 4).
// `wide`: also x's two digits as one int16, 256 * high + low, in xq_wide (AVX2's sums).
// `x_panel`, `terms_panel` (or null): also the digits and terms in x_panel_index's layout, the digits as one int16
// where `panel_wide` (int6k on VNNI, in x_wide_order).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t K, int64_t Kp, int8_t* xq_high, int8_t* xq_low,
                   int16_t* xq_wide, XBlockTerms* terms, bool wide, int8_t* x_panel, XBlockTerms* terms_panel,
                   bool panel_wide, int threads) {
    const int64_t x_blocks = Kp / kXBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 4)
    for (int64_t r = 0; r < rows; ++r) {
        quantize_row(x + r * K, K, Kp, xq_high + r * Kp, xq_low + r * Kp, terms + r * x_blocks);
        if (wide)
            for (int64_t k = r * Kp; k < (r + 1) * Kp; ++k)
                xq_wide[k] = static_cast<int16_t>(kDigitBase * xq_high[k] + xq_low[k]);
        if (x_panel == nullptr) continue;
        for (int64_t xb = 0; xb < x_blocks; ++xb) {
            const int64_t at = x_panel_index(r, x_blocks, xb);
            const int8_t* high = xq_high + r * Kp + xb * kXBlock;
            const int8_t* low = xq_low + r * Kp + xb * kXBlock;
            if (panel_wide) {
                join_wide(high, low, x_panel + at * kPanelEntryBytes);
            } else {
                std::memcpy(x_panel + at * kPanelEntryBytes, high, kXBlock);
                std::memcpy(x_panel + at * kPanelEntryBytes + kXBlock, low, kXBlock);
            }
            terms_panel[at] = terms[r * x_blocks + xb];
        }
    }
}

template <typename T>
void qlinear(const T* x, T* out, int64_t rows, int64_t K, int64_t N, int format, const void* packed,
             const uint16_t* scales, const uint16_t* mins, int64_t group, const float* bias, int threads) {
    const int64_t groups = format == kBf16 ? 1 : (K + group - 1) / group;
    const int64_t Kp = format == kBf16 ? K : groups * group;
    static thread_local std::vector<float> x_float;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<int16_t> xq_wide;
    static thread_local std::vector<XBlockTerms> x_terms;
    static thread_local std::vector<int8_t> x_panel;
    static thread_local std::vector<XBlockTerms> terms_panel;
#if defined(TOKENMILL_AMX)
    const bool on_tiles = amx_rows(format, rows);
#else
    constexpr bool on_tiles = false;
#endif
    if (format == kBf16) {
        x_float.resize(static_cast<size_t>(rows * Kp));
        to_float_rows(x, rows, K, Kp, x_float.data());
    } else {
        xq.resize(static_cast<size_t>(rows * Kp * 2));
        const bool wide = kWideX && !on_tiles;  // AVX2's form
        if (wide) xq_wide.resize(static_cast<size_t>(rows * Kp));
        x_terms.resize(static_cast<size_t>(rows * Kp / kXBlock));
        // the panel of block_sums' and int6k_block_sums' passes (the latter's digits as one int16)
        const bool panel = !kWideX && !on_tiles;
        const bool panel_wide = kWideInt6K && format == kInt6K;
        const int64_t panel_rows = (rows + kPanelRows - 1) / kPanelRows * kPanelRows;
        if (panel) {
            x_panel.resize(static_cast<size_t>(panel_rows * (Kp / kXBlock) * kPanelEntryBytes));
            terms_panel.resize(static_cast<size_t>(panel_rows * Kp / kXBlock));
        }
        quantize_rows(x, rows, K, Kp, xq.data(), xq.data() + rows * Kp, xq_wide.data(), x_terms.data(), wide,
                      panel ? x_panel.data() : nullptr, panel ? terms_panel.data() : nullptr, panel_wide, threads);
    }
    const int8_t* x_tiles = nullptr;
#if defined(TOKENMILL_AMX)
    static thread_local std::vector<int8_t> tiled;
    if (on_tiles) {
        tiled.resize(static_cast<size_t>((rows + kAmxTileRows - 1) / kAmxTileRows * groups * kAmxGroupBytes));
        tile_digits(xq.data(), xq.data() + rows * Kp, rows, Kp, tiled.data(), threads);
        x_tiles = tiled.data();
    }
#endif
    const Problem p{x_float.data(), xq.data(), xq.data() + rows * Kp, xq_wide.data(), x_tiles, x_terms.data(),
                    x_panel.data(), terms_panel.data(), rows, K, Kp, N, group, groups, packed, scales, mins, bias};
    const int64_t tiles = (N + kTileBlocks * kLanes - 1) / (kTileBlocks * kLanes);
    // The unit of work: half a tile, at every row count (a decode step's matmuls have 9 to 48 tiles, and
    // with whole tiles two threads split 9 as 5 + 4 and 15 as 8 + 7; halves split them evenly). Whole tiles
    // from 3 rows, as before, ran a step's matmuls 2-4% slower at 4 to 64 rows (2-core EPYC Zen 4).
    using Blocks = void (*)(const Problem&, int64_t, int64_t, T*);
    const Blocks run = format == kBf16    ? run_blocks<kBf16, T>
                       : format == kInt8  ? run_blocks<kInt8, T>
                       : format == kInt4K ? run_blocks<kInt4K, T>
                       : format == kInt6K ? run_blocks<kInt6K, T>
                                          : run_blocks<kInt4, T>;
    const int64_t unit = kTileBlocks / 2;
    const int64_t units = tiles * kTileBlocks / unit;
    // Units are handed out in about 8 chunks a thread, to whichever thread is free: on these VMs one vCPU runs
    // slower than the other from moment to moment (a neighbour, the host), and with fixed halves the step waited
    // for the slower one. Each unit writes its own outputs, so the sums and bits are the same. 2-core EPYC Zen 4,
    // the 1B Q4_K_M in process, static and dynamic alternated 3 / 2 times: one-row decode step p50 28.7 -> 26.5 ms,
    // eight rows 71.3 -> 65.4 ms, a 512-token prefill 4.49 -> 4.32 s; served, one streamed chat 29.8 -> 34.1 tok/s
    // (medians of 6, restarts alternated 3 times; each dynamic pair above the static pair beside it).
    const int64_t chunk = std::max<int64_t>(1, units / (threads * 8));
#pragma omp parallel for num_threads(threads) schedule(dynamic, chunk) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; ++u) run(p, u * unit, unit, out);
}

// One value of an int4k or int6k weight (output row block * 16 + lane, input k), as _dequantized_rows makes it.
__attribute__((optimize("fp-contract=off"))) float k_quant_value(int format, const uint8_t* bytes,
                                                                 const uint8_t* scales, int64_t block, int64_t lane,
                                                                 int64_t k, int64_t Kp) {
    const int64_t g = k / kXBlock, within = k % kXBlock, c = within % 16 / 4, half = within / 16;
    const int64_t super = block * (Kp / (kSuperGroups * kXBlock)) + g / kSuperGroups, j = g % kSuperGroups;
    const auto f16 = [](const uint8_t* at) {
        uint16_t bits;
        std::memcpy(&bits, at, sizeof(bits));
        return half_to_float(bits);
    };
    if (format == kInt4K) {
        const uint8_t byte = bytes[(((block * (Kp / kXBlock) + g) * 4 + c) * kLanes + lane) * 4 + within % 4];
        const uint8_t* s = scales + super * kInt4KSuperBytes;
        const float scale = f16(s + 2 * kSuperGroups * kLanes + 2 * lane) * static_cast<float>(s[j * kLanes + lane]);
        const float minimum = -(f16(s + 2 * kSuperGroups * kLanes + 2 * (kLanes + lane)) *
                                static_cast<float>(s[(kSuperGroups + j) * kLanes + lane]));
        return static_cast<float>(half == 0 ? byte & 15 : byte >> 4) * scale + minimum;
    }
    const uint8_t* group_bytes = bytes + (block * (Kp / kXBlock) + g) * kInt6KGroupBytes;
    const uint8_t byte = group_bytes[(c * kLanes + lane) * 4 + within % 4];
    const uint8_t high = group_bytes[256 + half * 64 + lane * 4 + within % 4];
    static constexpr int kShift[4] = {4, 6, 0, 2};
    const int q = (half == 0 ? byte & 15 : byte >> 4) | (((high >> kShift[c]) & 3) << 4);
    const uint8_t* s = scales + super * kInt6KSuperBytes;
    const float scale = f16(s + 2 * kSuperGroups * kLanes + 2 * lane) *
                        static_cast<float>(static_cast<int8_t>(s[(j * 2 + half) * kLanes + lane]));
    return static_cast<float>(q - 32) * scale;
}

// Rows `ids` of a packed weight as float32 [count][K]: a tied embedding is held only in the head's packed form.
// The values and roundings of kernels/qlinear.py's _dequantized_rows (q * scale, then + min: not fused).
__attribute__((optimize("fp-contract=off"))) void packed_rows(const int64_t* ids, int64_t count, int format,
                                                              const void* packed, const uint16_t* scales,
                                                              const uint16_t* mins, int64_t K, int64_t Kp,
                                                              int64_t group, float* out) {
    const int64_t groups = Kp / group;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t block = ids[i] / kLanes, lane = ids[i] % kLanes;
        float* row = out + i * K;
        for (int64_t k = 0; k < K; ++k) {
            if (format == kBf16) {
                row[k] = tokenmill::to_float(static_cast<const uint16_t*>(packed)[(block * Kp + k) * kLanes + lane]);
                continue;
            }
            const uint8_t* bytes = static_cast<const uint8_t*>(packed);
            if (format == kInt4K || format == kInt6K) {
                row[k] = k_quant_value(format, bytes, reinterpret_cast<const uint8_t*>(scales), block, lane, k, Kp);
                continue;
            }
            const int64_t at = (block * groups + k / group) * kLanes + lane;
            float q;
            if (format == kInt8) {
                q = static_cast<float>(bytes[((block * (Kp / 4) + k / 4) * kLanes + lane) * 4 + k % 4] - 128);
            } else {  // int4: group of 32, low nibbles k 0..15, high nibbles k 16..31
                const int64_t within = k % kXBlock, c = within % 16 / 4;
                const uint8_t byte = bytes[(((block * (Kp / kXBlock) + k / kXBlock) * 4 + c) * kLanes + lane) * 4 + within % 4];
                q = static_cast<float>(within < 16 ? byte & 15 : byte >> 4);
            }
            const float scaled = q * half_to_float(scales[at]);
            row[k] = mins != nullptr ? scaled + half_to_float(mins[at]) : scaled;
        }
    }
}

// GGUF's Q4_K and Q6_K blocks (llama.cpp's block_q4_K: d, dmin, 12 bytes of 6-bit scales and minimums, 128 of
// nibbles; block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d) written straight into
// int4k's and int6k's packed layout (the top of this file), one block of 16 rows per iteration: the same bytes
// as the loader's numpy and torch rearrangement of them (engine/gguf_repack.py, kernels/qlinear.py's
// _pack_k_quant), which ran at ~200 MB/s, 5x slower, and was most of a 1B Q4_K_M's model load.
constexpr int64_t kQ4KBlockBytes = 144;
constexpr int64_t kQ6KBlockBytes = 210;
constexpr int64_t kSuperInputs = kSuperGroups * kXBlock;

// Q4_K's 6-bit scale and minimum of its sub-block j (llama.cpp's get_scale_min_k4)
inline void q4k_scale_min(const uint8_t* packed, int j, uint8_t& scale, uint8_t& minimum) {
    if (j < 4) {
        scale = packed[j] & 63;
        minimum = packed[j + 4] & 63;
    } else {
        scale = static_cast<uint8_t>((packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4));
        minimum = static_cast<uint8_t>((packed[j + 4] >> 4) | ((packed[j] >> 6) << 4));
    }
}

// The 32 codes of group `j` (0..7) of a super block, as bytes: Q4_K's in 0..15, Q6_K's in 0..63
inline void q4k_group_codes(const uint8_t* block, int j, uint8_t (&codes)[kXBlock]) {
    const uint8_t* nibbles = block + 16 + 32 * (j / 2);  // sub-blocks 2r and 2r + 1 share 32 bytes: low, high
    const int shift = 4 * (j % 2);
    for (int i = 0; i < kXBlock; ++i) codes[i] = (nibbles[i] >> shift) & 15;
}
inline void q6k_group_codes(const uint8_t* block, int j, uint8_t (&codes)[kXBlock]) {
    const int half = j / 4;  // Q6_K's two halves of 128 inputs: input t of a half takes low nibble
    const uint8_t* low = block + 64 * half;        // (t / 64) of byte t % 64 and high bit pair (t / 32) of
    const uint8_t* high = block + 128 + 32 * half;  // byte t % 32
    for (int i = 0; i < kXBlock; ++i) {
        const int t = 32 * (j % 4) + i;
        codes[i] = static_cast<uint8_t>(((low[t % 64] >> (4 * (t / 64))) & 15) | (((high[t % 32] >> (2 * (t / 32))) & 3) << 4));
    }
}

// `rows` (a multiple of 16) rows of K inputs: blocks [rows][K/256][block bytes] -> codes [rows/16][K/32][bytes per
// group] and scales [rows/16][K/256][bytes per super block], as _pack_k_quant lays them out.
void pack_k_quant_blocks(int format, const uint8_t* blocks, int64_t rows, int64_t K, uint8_t* codes, uint8_t* scales,
                         int threads) {
    const bool int4k = format == kInt4K;
    const int64_t supers = K / kSuperInputs, groups = K / kXBlock;
    const int64_t block_bytes = int4k ? kQ4KBlockBytes : kQ6KBlockBytes;
    const int64_t group_bytes = int4k ? 256 : kInt6KGroupBytes;
    const int64_t super_bytes = int4k ? kInt4KSuperBytes : kInt6KSuperBytes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t lanes = 0; lanes < rows / kLanes; ++lanes) {
        for (int64_t lane = 0; lane < kLanes; ++lane) {
            const uint8_t* row = blocks + (lanes * kLanes + lane) * supers * block_bytes;
            for (int64_t s = 0; s < supers; ++s) {
                const uint8_t* block = row + s * block_bytes;
                uint8_t* super = scales + (lanes * supers + s) * super_bytes;
                if (int4k) {  // sc [8][16], m [8][16], d [16], dmin [16]
                    for (int j = 0; j < kSuperGroups; ++j)
                        q4k_scale_min(block + 4, j, super[j * kLanes + lane], super[(kSuperGroups + j) * kLanes + lane]);
                    std::memcpy(super + 2 * kSuperGroups * kLanes + 2 * lane, block, 2);
                    std::memcpy(super + 2 * kSuperGroups * kLanes + 2 * kLanes + 2 * lane, block + 2, 2);
                } else {  // sc [16 per 16 inputs][16], d [16]
                    for (int h = 0; h < 2 * kSuperGroups; ++h) super[h * kLanes + lane] = block[192 + h];
                    std::memcpy(super + 2 * kSuperGroups * kLanes + 2 * lane, block + 208, 2);
                }
                for (int j = 0; j < kSuperGroups; ++j) {
                    uint8_t q[kXBlock];
                    if (int4k) {
                        q4k_group_codes(block, j, q);
                    } else {
                        q6k_group_codes(block, j, q);
                    }
                    uint8_t* out = codes + (lanes * groups + s * kSuperGroups + j) * group_bytes;
                    for (int c = 0; c < 4; ++c)
                        for (int i = 0; i < 4; ++i) {  // byte (c, lane, i): inputs 4c + i and 16 + 4c + i
                            out[(c * kLanes + lane) * 4 + i] =
                                static_cast<uint8_t>((q[4 * c + i] & 15) | ((q[16 + 4 * c + i] & 15) << 4));
                        }
                    if (!int4k) {  // byte (half, lane, i): the high bit pairs of inputs 16 half + 4c + i, c = 0..3
                        static constexpr int kShift[4] = {4, 6, 0, 2};
                        for (int half = 0; half < 2; ++half)
                            for (int i = 0; i < 4; ++i) {
                                int bits = 0;
                                for (int c = 0; c < 4; ++c) bits |= ((q[16 * half + 4 * c + i] >> 4) & 3) << kShift[c];
                                out[256 + (half * kLanes + lane) * 4 + i] = static_cast<uint8_t>(bits);
                            }
                    }
                }
            }
        }
    }
}

}  // namespace

extern "C" {

const char* tokenmill_qlinear_vector_unit() { return TOKENMILL_VEC; }

// Whether the int4k / int6k kernels run on AMX from kAmxRows rows: `enable` 1 or 0 sets it (where AMX is usable),
// -1 only asks.
int tokenmill_qlinear_amx(int enable) {
#if defined(TOKENMILL_AMX)
    if (enable >= 0) amx_enabled.store(enable != 0);
    return amx_enabled.load() && amx_usable() ? 1 : 0;
#else
    (void)enable;
    return 0;
#endif
}

// 0, or -1 (and nothing written) when an id is outside [0, N).
int tokenmill_packed_rows(const int64_t* ids, int64_t count, int64_t N, int format, const void* packed,
                          const uint16_t* scales, const uint16_t* mins, int64_t K, int64_t Kp, int64_t group, float* out) {
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    packed_rows(ids, count, format, packed, scales, mins, K, Kp, group, out);
    return 0;
}

// 0, or -1 (nothing written) for a format other than int4k / int6k or a shape off 16 rows and 256 inputs.
int tokenmill_pack_k_quant_blocks(int format, const uint8_t* blocks, int64_t rows, int64_t K, uint8_t* codes,
                                  uint8_t* scales, int threads) {
    if ((format != kInt4K && format != kInt6K) || rows % kLanes != 0 || K % kSuperInputs != 0) return -1;
    pack_k_quant_blocks(format, blocks, rows, K, codes, scales, threads);
    return 0;
}

void tokenmill_qlinear_f32(const float* x, float* out, int64_t rows, int64_t K, int64_t N, int format,
                           const void* packed, const uint16_t* scales, const uint16_t* mins, int64_t group,
                           const float* bias, int threads) {
    qlinear(x, out, rows, K, N, format, packed, scales, mins, group, bias, threads);
}

void tokenmill_qlinear_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t K, int64_t N, int format,
                            const void* packed, const uint16_t* scales, const uint16_t* mins, int64_t group,
                            const float* bias, int threads) {
    qlinear(x, out, rows, K, N, format, packed, scales, mins, group, bias, threads);
}

}  // extern "C"
