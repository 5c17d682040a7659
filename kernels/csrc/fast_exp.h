// e^x in a form the compiler vectorizes (a loop of std::exp stays scalar libm calls without
// -ffast-math, and those calls were the largest cost of the softmax and SiLU loops). Cody-Waite range
// reduction and a degree-6 polynomial: within 2 ulp of expf over [-87, 88]; outside, clamped.
#pragma once
#include <cstdint>
#include <cstring>

namespace tokenmill {

inline float fast_exp(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    // Round to nearest by adding and removing 1.5 * 2^23 (vectorizes, unlike a call to roundevenf).
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, in two parts
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    // 2^n built in two halves so that n = 128 (x near 88) does not overflow the exponent field.
    const int32_t half = static_cast<int32_t>(n) / 2;
    const int32_t low_bits = (half + 127) << 23, high_bits = (static_cast<int32_t>(n) - half + 127) << 23;
    float low, high;
    std::memcpy(&low, &low_bits, sizeof(low));
    std::memcpy(&high, &high_bits, sizeof(high));
    return p * low * high;
}

}  // namespace tokenmill
