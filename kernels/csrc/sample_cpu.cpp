// One sampled token per row: temperature, top-k, top-p and min-p, then one inverse-CDF draw, in one call.
//
// Why native code: in torch the same work is ~20 ops a step (max, scale, top-k over the vocabulary,
// logsumexp, cumsum, a vocabulary-wide threshold, exp, two-level cumsum, searchsorted), each a pass over
// 49k floats and a Python call; at one stream that was ~0.8 ms of a ~8 ms token. Here a row takes three
// passes (max; scale and exp; gather of the candidates above a cut) and sorts only the candidates.
//
// Semantics are engine/sampler.py's (kernels/sampling.py holds the plain torch reference): logits are
// scaled as (x - max) / T; top-k keeps logits >= the k-th largest, top-p keeps the smallest prefix of the
// sorted (top-k) tokens whose preceding mass is below p, min-p keeps logits >= max + log(min_p) in the
// scaled domain, and ties at each edge are kept. The draw takes the first token, in vocabulary order, whose
// running sum of weights reaches (1 - u) * total.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fast_exp.h"

namespace {

using tokenmill::fast_exp;

// Candidate cut-offs in the scaled domain (e^-8 .. e^-64 of the best token's weight), narrowest first: the
// first that holds the k best or p of the mass is kept, so a peaked row sorts a few hundred tokens at most.
constexpr float kLevelCuts[] = {-8.f, -16.f, -32.f, -64.f, -std::numeric_limits<float>::infinity()};
// Below e^-87 the weight is taken as 0 (fast_exp clamps there): 49k such tokens weigh < 1e-33.
constexpr float kZeroBelow = -87.f;
constexpr int64_t kDrawBlock = 256;
// Candidate sets above this are narrowed by selection (nth_element) before the sort: a flat row at a high
// temperature keeps tens of thousands of tokens.
constexpr int64_t kSortDirectly = 2048;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Candidate {
    float scaled;
    float weight;
    int32_t token;
};

bool ranks_higher(const Candidate& a, const Candidate& b) {
    return a.scaled > b.scaled || (a.scaled == b.scaled && a.token < b.token);
}

float row_max(const float* x, int64_t vocab) {
    float best = kNegInf;
#pragma omp simd reduction(max : best)
    for (int64_t i = 0; i < vocab; ++i) best = x[i] > best ? x[i] : best;
    return best;
}

// scaled[i] = (x[i] - max) / T and weight[i] = e^scaled[i] (0 below e^-87); returns the total weight.
float scale_and_weigh(const float* x, int64_t vocab, float max, float inverse_temperature, float* scaled,
                      float* weight) {
    double total = 0.;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) {
        const float s = (x[i] - max) * inverse_temperature;
        const float w = s >= kZeroBelow ? fast_exp(s) : 0.f;
        scaled[i] = s;
        weight[i] = w;
        total += w;
    }
    return static_cast<float>(total);
}

// Appends the tokens whose scaled logit is >= cut, in vocabulary order. `tokens` has room for vocab + 16.
int64_t tokens_at_or_above(const float* scaled, int64_t vocab, float cut, int32_t* tokens) {
    int64_t found = 0, i = 0;
#if defined(__AVX512F__)
    // Compress in a register, then store all 16 lanes: a compress straight to memory is microcoded and
    // slow on AMD Zen 4. Most blocks hold none and cost a compare and a branch.
    const __m512 cut_lanes = _mm512_set1_ps(cut);
    __m512i lane_tokens = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= vocab; i += 16, lane_tokens = _mm512_add_epi32(lane_tokens, step)) {
        const __mmask16 in = _mm512_cmp_ps_mask(_mm512_loadu_ps(scaled + i), cut_lanes, _CMP_GE_OQ);
        if (in == 0) continue;
        _mm512_storeu_si512(tokens + found, _mm512_maskz_compress_epi32(in, lane_tokens));
        found += __builtin_popcount(in);
    }
#endif
    for (; i < vocab; ++i)
        if (scaled[i] >= cut) tokens[found++] = static_cast<int32_t>(i);
    return found;
}

// Every token at or above the narrowest level cut that holds `top_k` tokens (when > 0) or `mass` of the
// weight; returns the cut.
float gather(const float* scaled, const float* weight, int64_t vocab, int64_t top_k, float mass,
             std::vector<int32_t>& tokens, std::vector<Candidate>& out) {
    tokens.resize(vocab + 16);
    for (float cut : kLevelCuts) {
        const int64_t found = tokens_at_or_above(scaled, vocab, cut, tokens.data());
        float held = 0.f;
        for (int64_t i = 0; i < found; ++i) held += weight[tokens[i]];
        if (cut == kLevelCuts[std::size(kLevelCuts) - 1] || (top_k > 0 ? found >= top_k : held >= mass)) {
            out.resize(found);
            for (int64_t i = 0; i < found; ++i) out[i] = {scaled[tokens[i]], weight[tokens[i]], tokens[i]};
            return cut;
        }
    }
    return kNegInf;  // not reached: the last cut holds everything
}

// The last candidate, in rank order, whose preceding weight is below `wanted` (the nucleus's edge), among
// candidates[0, count). Big sets are narrowed by selection first: split at the middle rank, keep the half
// where the running weight crosses `wanted`. Sums in double: a p of 0.999 over a flat row ends among tokens
// of ~1e-6 each, and 40k float additions would move that edge by several tokens.
float nucleus_edge(std::vector<Candidate>& candidates, int64_t count, double wanted) {
    auto begin = candidates.begin();
    int64_t low = 0, high = count;
    double before = 0.;
    while (high - low > kSortDirectly) {
        const int64_t middle = low + (high - low) / 2;
        std::nth_element(begin + low, begin + middle, begin + high, ranks_higher);
        double upper = 0.;
        for (int64_t i = low; i < middle; ++i) upper += candidates[i].weight;
        if (before + upper >= wanted) {
            high = middle;
        } else {
            before += upper;
            low = middle;
        }
    }
    std::sort(begin + low, begin + high, ranks_higher);
    int64_t last = low;
    for (int64_t i = low; i < high && before < wanted; ++i) {
        before += candidates[i].weight;
        last = i;
    }
    return candidates[last].scaled;
}

// The smallest scaled logit that top-k and top-p keep (-inf when neither applies). Leaves in `candidates`
// every token at or above `cut`, which is at most the returned edge.
float truncation_edge(const float* scaled, const float* weight, int64_t vocab, int64_t top_k, float top_p,
                      float total, std::vector<int32_t>& tokens, std::vector<Candidate>& candidates, float& cut) {
    const bool has_top_k = top_k > 0 && top_k < vocab, has_top_p = top_p < 1.f;
    cut = kNegInf;
    if (!has_top_k && !has_top_p) return kNegInf;
    // With top-k, the nucleus lies inside the k best, so holding them is enough.
    cut = gather(scaled, weight, vocab, has_top_k ? top_k : 0, top_p * total, tokens, candidates);
    int64_t considered = static_cast<int64_t>(candidates.size());
    float edge = kNegInf;
    double normaliser = total;
    if (has_top_k) {
        considered = top_k;  // the level holds at least k
        std::nth_element(candidates.begin(), candidates.begin() + (top_k - 1), candidates.end(), ranks_higher);
        edge = candidates[top_k - 1].scaled;  // the k-th best; ranks [0, k) are the k best, unordered
        normaliser = 0.;
        for (int64_t i = 0; i < top_k; ++i) normaliser += candidates[i].weight;
    }
    if (has_top_p) edge = std::max(edge, nucleus_edge(candidates, considered, top_p * normaliser));
    return edge;
}

// The first token, in vocabulary order, whose running weight reaches (1 - u) of the total.
int64_t draw_among(std::vector<Candidate>& kept, float uniform) {
    std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.token < b.token; });
    float total = 0.f;
    for (const Candidate& c : kept) total += c.weight;
    const float target = (1.f - uniform) * total;
    float running = 0.f;
    int64_t last = kept.front().token;
    for (const Candidate& c : kept) {
        if (c.weight <= 0.f) continue;
        running += c.weight;
        last = c.token;
        if (running >= target) return c.token;
    }
    return last;  // rounding left the target a hair above the running sum
}

// The same over the whole vocabulary, in two levels (block sums, then inside one block), as a running sum
// of 49k floats does not vectorise. Zeroes the weights of tokens below `floor`.
int64_t draw_from_vocabulary(const float* scaled, float* weight, int64_t vocab, float floor, float uniform) {
    const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
    std::vector<float> block_sum(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t end = std::min(vocab, (b + 1) * kDrawBlock);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = b * kDrawBlock; i < end; ++i) {
            const float w = scaled[i] >= floor ? weight[i] : 0.f;
            weight[i] = w;
            sum += w;
        }
        block_sum[b] = sum;
    }
    float total = 0.f;
    for (float s : block_sum) total += s;
    const float target = (1.f - uniform) * total;
    float before = 0.f;
    int64_t block = 0;
    // The block whose running sum reaches the target, skipping empty ones (the best token's block has weight).
    while (block < blocks - 1 && (block_sum[block] <= 0.f || before + block_sum[block] < target))
        before += block_sum[block++];
    while (block_sum[block] <= 0.f) before -= block_sum[--block];
    const int64_t start = block * kDrawBlock, end = std::min(vocab, start + kDrawBlock);
    float running = before;
    int64_t last = -1;
    for (int64_t i = start; i < end; ++i) {
        if (weight[i] <= 0.f) continue;
        running += weight[i];
        last = i;
        if (running >= target) return i;
    }
    return last;
}

struct RowBuffers {
    std::vector<float> scaled, weight;
    std::vector<int32_t> tokens;
    std::vector<Candidate> candidates;
};

int64_t sample_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                   float uniform, RowBuffers& buffers, float* probabilities) {
    const float max = row_max(x, vocab);
    if (!(max > kNegInf)) return 0;  // nothing to draw from; the caller's logits were all -inf (or NaN)
    float* scaled = buffers.scaled.data();
    float* weight = buffers.weight.data();
    std::vector<Candidate>& candidates = buffers.candidates;
    const float total = scale_and_weigh(x, vocab, max, 1.f / temperature, scaled, weight);
    float cut;
    float floor = truncation_edge(scaled, weight, vocab, top_k, top_p, total, buffers.tokens, candidates, cut);
    if (min_p > 0.f) floor = std::max(floor, std::log(min_p));
    if (floor >= cut && cut > kNegInf) {
        // Every kept token is a candidate: draw among those at or above the floor.
        candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                        [floor](const Candidate& c) { return c.scaled < floor; }),
                         candidates.end());
        if (probabilities != nullptr) {
            std::fill(probabilities, probabilities + vocab, 0.f);
            float sum = 0.f;
            for (const Candidate& c : candidates) sum += c.weight;
            for (const Candidate& c : candidates) probabilities[c.token] = c.weight / sum;
        }
        return draw_among(candidates, uniform);
    }
    const int64_t token = draw_from_vocabulary(scaled, weight, vocab, floor, uniform);
    if (probabilities != nullptr) {
        float sum = 0.f;
        for (int64_t i = 0; i < vocab; ++i) sum += weight[i];
        for (int64_t i = 0; i < vocab; ++i) probabilities[i] = weight[i] / sum;
    }
    return token;
}

}  // namespace

extern "C" {
// The first index of each row's maximum (torch.argmax's answer): the greedy token.
void tokenmill_argmax_f32(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride, int64_t* tokens) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * row_stride;
        const float max = row_max(x, vocab);
        int64_t i = 0;
        while (i < vocab - 1 && !(x[i] == max)) ++i;
        tokens[r] = i;
    }
}

// logits: rows x vocab float32, rows `row_stride` apart (0 for a broadcast row). probabilities, when not
// null: rows x vocab, each row the normalised distribution the token was drawn from (for tests).
void tokenmill_sample_f32(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                          const float* temperature, const int64_t* top_k, const float* top_p, const float* min_p,
                          const float* uniform, int64_t* tokens, float* probabilities, int threads) {
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, rows))) if (rows > 1)
    {
        RowBuffers buffers{std::vector<float>(vocab), std::vector<float>(vocab), {}, {}};
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            tokens[r] = sample_row(logits + r * row_stride, vocab, temperature[r], top_k[r], top_p[r], min_p[r],
                                   uniform[r], buffers,
                                   probabilities != nullptr ? probabilities + r * vocab : nullptr);
        }
    }
}
}
