// bfloat16 <-> float for the native CPU kernels, rounding as torch does (nearest even).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenmill {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
    uint32_t bits = static_cast<uint32_t>(bf16) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

// Stores x in the element type and returns the stored value, as a float.
inline float store(float x, float* out) {
    *out = x;
    return x;
}
inline float store(float x, uint16_t* out) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    *out = static_cast<uint16_t>(x != x ? 0x7fc0u : rounded);  // a select, not a branch: loops vectorize
    return to_float(*out);
}

template <typename T>
inline float round_to(float x) {
    T rounded;
    return store(x, &rounded);
}

}  // namespace tokenmill
