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
    if (std::isnan(x)) {
        *out = 0x7fc0;
        return x;
    }
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits += 0x7fff + ((bits >> 16) & 1);
    *out = static_cast<uint16_t>(bits >> 16);
    return to_float(*out);
}

template <typename T>
inline float round_to(float x) {
    T rounded;
    return store(x, &rounded);
}

}  // namespace tokenmill
