// Matrix products of a few activation rows with int8 or int4 weights, for a CPU with AVX2 and FMA (models/native.py
// builds and loads this file; infer/quantize.py calls it for decoding steps on CPUs without native bf16).
//
// y[r][n] = sum_k x[r][k] w[n][k], x and y in fp32, K a multiple of 32, the weight read once per call in its codes:
// * int8: one byte a weight, w = q · s[n] (the scale applied to the finished sum);
// * int4: half a byte a weight, w = (q - 8) · s + z with scale s and zero point z of output channel n and group g
//   of `group` inputs (32, 64 or 128), held as pairs (N, K/group, 2) in fp32 or bf16 (the layout and arithmetic of
//   PyTorch's int4 CPU kernel). Row n holds K/2 bytes in runs of 16 per 32 inputs: byte j of run b holds input
//   32b + j in its low four bits and input 32b + 16 + j in its high four (the order of a GGUF Q4 block, so one load
//   and two masks give 32 codes).
// The activations are first rounded to 8 bits per block of 32 (a scale d = max |x| / 127 a block, x ≈ d · round(x /
// d), as llama.cpp's Q8 activations are), so that 32 products are one integer multiply-add of bytes (AVX2's
// `maddubs`: unsigned × signed bytes, summed in pairs; int8 codes enter as |q| against x's codes carrying q's
// sign), one conversion to fp32, and one fused multiply-add by the block's scales: about half the instructions of
// widening each code to fp32 (a first version, compute-bound for int4). An int4 group's offset (z - 8s) multiplies
// the block's sum of the unrounded activations. Up to 4 rows share each weight vector loaded; output channels are
// split over the threads in contiguous shares of tiles. Measured in benchmarks/RESULTS.md, "int8 and int4 rows of
// meshlm's own" and "The quantized rows as C++ operators": faster than PyTorch's kernels in an eager step; inside a
// compiled one faster in int4 and slower in int8 than the code Inductor generates. Plain C++ (no PyTorch headers),
// compiled with the OpenMP runtime PyTorch has loaded, as paged_decode.cpp is; quant_ops.cpp, built with it into one
// library, registers these functions as the operators meshlm::int8_rows and meshlm::int4_rows.

#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int BLOCK = 32;    // activations sharing one 8-bit scale
constexpr int MAX_ROWS = 4;  // rows sharing one weight vector loaded
constexpr int AHEAD = 8;     // a tile asks for the weight rows of the tile this many tiles on (about 18 KB)

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Asks for the `bytes` from p on (hardware prefetchers alone left one row read at 5 GB/s from memory, 12 with this).
inline void prefetch(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

inline float scalar(float v) { return v; }
inline float scalar(uint16_t h) {  // bf16
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

// One row's activations as 8-bit codes per block of 32: xq (K) int8, d (K/32) scales, sums (K/32) the blocks'
// sums of x itself. d = max |x| / 127 (0 for a block of zeros), code = round(x · (1/d)) to nearest even.
void quantize_row(const float* x, int64_t K, int8_t* xq, float* d, float* sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
    for (int64_t b = 0; b < K / BLOCK; ++b) {
        const float* xb = x + BLOCK * b;
        __m256 v[4];
        __m256 top = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
            sum = _mm256_add_ps(sum, v[i]);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float scale = _mm_cvtss_f32(m) / 127.0f;
        d[b] = scale;
        sums[b] = hsum(sum);
        const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        __m256i c[4];
        for (int i = 0; i < 4; ++i)
            c[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + BLOCK * b), _mm256_permutevar8x32_epi32(bytes, order));
    }
}

// The rows' codes, scales and sums (rows after each other; per-thread buffers reused across calls).
struct Rows {
    int8_t* q;
    float* d;
    float* sums;
    int64_t K;
};

// NR rows × NT output channels (rows of q, stride K) → y[r * ldy + t], int8 codes.
template <int NR, int NT, typename S>
void int8_tile(Rows x, const int8_t* q, const S* s, float* y, int64_t ldy) {
    const int64_t K = x.K, nb = K / BLOCK;
    prefetch(q + AHEAD * NT * K, NT * K);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR][NT];
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i w[NT], mag[NT];
        for (int t = 0; t < NT; ++t) {
            w[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * K + BLOCK * b));
            mag[t] = _mm256_sign_epi8(w[t], w[t]);  // |q| (q in -127..127)
        }
        for (int r = 0; r < NR; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * K + BLOCK * b));
            const __m256 scale = _mm256_set1_ps(x.d[r * nb + b]);
            for (int t = 0; t < NT; ++t) {
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[t], _mm256_sign_epi8(xv, w[t])), ones);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t) y[r * ldy + t] = hsum(acc[r][t]) * scalar(s[t]);
}

// The same for int4 codes: row t's codes at p + t * K/2, its groups' (scale, zero) pairs at sz + 2 * t * K/group.
template <int NR, int NT, typename S>
void int4_tile(Rows x, const uint8_t* p, const S* sz, int64_t group, float* y, int64_t ldy) {
    const int64_t K = x.K, nb = K / BLOCK, groups = K / group;
    prefetch(p + AHEAD * NT * (K / 2), NT * (K / 2));
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[NR][NT];
    float offset[NR][NT];
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t) {
            acc[r][t] = _mm256_setzero_ps();
            offset[r][t] = 0.0f;
        }
    float scale[NT] = {}, shift[NT] = {};  // the group's s and z - 8s, set at its first block (b = 0 first)
    for (int64_t b = 0; b < nb; ++b) {
        __m256i codes[NT];
        for (int t = 0; t < NT; ++t) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t * (K / 2) + 16 * b));
            codes[t] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
            if ((BLOCK * b) % group == 0) {
                const S* pair = sz + 2 * (t * groups + BLOCK * b / group);
                scale[t] = scalar(pair[0]);
                shift[t] = scalar(pair[1]) - 8.0f * scale[t];
            }
        }
        for (int r = 0; r < NR; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * K + BLOCK * b));
            const float d = x.d[r * nb + b], sum = x.sums[r * nb + b];
            for (int t = 0; t < NT; ++t) {
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[t], xv), ones);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * scale[t]), acc[r][t]);
                offset[r][t] += shift[t] * sum;
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t) y[r * ldy + t] = hsum(acc[r][t]) + offset[r][t];
}

// Rows r .. r + nr of x (`nr` up to MAX_ROWS) from row r's codes on, the template for nr.
Rows from(const Rows& x, int64_t r) {
    const int64_t nb = x.K / BLOCK;
    return {x.q + r * x.K, x.d + r * nb, x.sums + r * nb, x.K};
}

template <int NT, typename S>
void int8_block(int nr, Rows x, const int8_t* q, const S* s, float* y, int64_t ldy) {
    switch (nr) {
        case 1: int8_tile<1, NT>(x, q, s, y, ldy); break;
        case 2: int8_tile<2, NT>(x, q, s, y, ldy); break;
        case 3: int8_tile<3, NT>(x, q, s, y, ldy); break;
        default: int8_tile<4, NT>(x, q, s, y, ldy); break;
    }
}

template <int NT, typename S>
void int4_block(int nr, Rows x, const uint8_t* p, const S* sz, int64_t group, float* y, int64_t ldy) {
    switch (nr) {
        case 1: int4_tile<1, NT>(x, p, sz, group, y, ldy); break;
        case 2: int4_tile<2, NT>(x, p, sz, group, y, ldy); break;
        case 3: int4_tile<3, NT>(x, p, sz, group, y, ldy); break;
        default: int4_tile<4, NT>(x, p, sz, group, y, ldy); break;
    }
}

// Room for R rows of K in `codes` and `scales` (resized to fit), as a Rows view; `quantize_row` fills it.
Rows room(int64_t R, int64_t K, std::vector<int8_t>& codes, std::vector<float>& scales) {
    const int64_t nb = K / BLOCK;
    codes.resize(R * K);
    scales.resize(2 * R * nb);
    return {codes.data(), scales.data(), scales.data() + R * nb, K};
}

// The rows quantized, then output channels in tiles (4 for one row, whose 4 sums are then the only chains of
// products; 2 for more rows, whose sums are chains enough), each thread a contiguous share of the tiles; a tile's
// weight rows stay in cache across its row blocks. Up to MAX_ROWS rows each thread quantizes for itself (no wait
// for the others: one call of a 576 × 576 layer reads its 330 KB in about 15 µs); more rows are quantized once,
// shared out. tile(codes, r, n, nr, width): rows r .. r + nr (their codes from `codes` on) of channels n .. n +
// width. Each thread asks for its first tiles' weights before it quantizes (`first(n, count)`).
template <typename Tile, typename First>
void run(const float* x, int64_t R, int64_t K, int64_t N, int threads, Tile&& tile, First&& first) {
    static thread_local std::vector<int8_t> codes;
    static thread_local std::vector<float> scales;
    const int64_t nb = K / BLOCK;
    const bool alone = R <= MAX_ROWS;
    const Rows shared = alone ? Rows{} : room(R, K, codes, scales);  // this thread's buffers, filled by the team
    const int64_t nt = R == 1 ? 4 : 2;
    const int64_t tiles = (N + nt - 1) / nt;
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = tiles * me / team, hi = tiles * (me + 1) / team;
        if (hi > lo) first(lo * nt, AHEAD * nt);
        const Rows rows = alone ? room(R, K, codes, scales) : shared;  // alone: each thread's own buffers
        if (alone) {
            for (int64_t r = 0; r < R; ++r)
                quantize_row(x + r * K, K, rows.q + r * K, rows.d + r * nb, rows.sums + r * nb);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; ++r)
                quantize_row(x + r * K, K, rows.q + r * K, rows.d + r * nb, rows.sums + r * nb);
        }
        for (int64_t i = lo; i < hi; ++i) {
            const int64_t n = i * nt;
            const int64_t width = N - n < nt ? N - n : nt;
            for (int64_t r = 0; r < R; r += MAX_ROWS)
                tile(from(rows, r), r, n, static_cast<int>(R - r < MAX_ROWS ? R - r : MAX_ROWS), width);
        }
    }
}

template <typename S>
void int8_run(const float* x, const int8_t* q, const S* s, float* y, int64_t R, int64_t K, int64_t N, int threads) {
    run(
        x, R, K, N, threads,
        [&](Rows xr, int64_t r, int64_t n, int nr, int64_t width) {
            float* yr = y + r * N;
            if (width == 4) int8_block<4>(nr, xr, q + n * K, s + n, yr + n, N);
            else if (width == 2) int8_block<2>(nr, xr, q + n * K, s + n, yr + n, N);
            else
                for (int64_t c = n; c < n + width; ++c) int8_block<1>(nr, xr, q + c * K, s + c, yr + c, N);
        },
        [&](int64_t n, int64_t count) { prefetch(q + n * K, (N - n < count ? N - n : count) * K); });
}

template <typename S>
void int4_run(const float* x, const uint8_t* p, const S* sz, float* y, int64_t R, int64_t K, int64_t N,
              int64_t group, int threads) {
    const int64_t pairs = 2 * (K / group);  // (scale, zero) values per output channel
    run(
        x, R, K, N, threads,
        [&](Rows xr, int64_t r, int64_t n, int nr, int64_t width) {
            float* yr = y + r * N;
            if (width == 4)
                int4_block<4>(nr, xr, p + n * (K / 2), sz + n * pairs, group, yr + n, N);
            else if (width == 2)
                int4_block<2>(nr, xr, p + n * (K / 2), sz + n * pairs, group, yr + n, N);
            else
                for (int64_t c = n; c < n + width; ++c)
                    int4_block<1>(nr, xr, p + c * (K / 2), sz + c * pairs, group, yr + c, N);
        },
        [&](int64_t n, int64_t count) { prefetch(p + n * (K / 2), (N - n < count ? N - n : count) * (K / 2)); });
}

}  // namespace

extern "C" {

// x (R, K) fp32 contiguous, K a multiple of 32; q (N, K) int8 contiguous; s (N) scales, fp32 (s_dtype 0) or bf16
// (1); y (R, N) fp32 contiguous.
int meshlm_int8_rows(const float* x, const int8_t* q, const void* s, int s_dtype, float* y, int64_t R, int64_t K,
                     int64_t N, int threads) {
    if (R <= 0 || K <= 0 || N <= 0 || K % BLOCK) return 1;
    if (s_dtype == 0)
        int8_run(x, q, static_cast<const float*>(s), y, R, K, N, threads);
    else if (s_dtype == 1)
        int8_run(x, q, static_cast<const uint16_t*>(s), y, R, K, N, threads);
    else
        return 2;
    return 0;
}

// x (R, K) fp32 contiguous; p (N, K/2) uint8 in the layout above, K a multiple of 32 and of group; sz (N, K/group,
// 2) (scale, zero) pairs, fp32 (sz_dtype 0) or bf16 (1); y (R, N) fp32 contiguous.
int meshlm_int4_rows(const float* x, const uint8_t* p, const void* sz, int sz_dtype, float* y, int64_t R, int64_t K,
                     int64_t N, int64_t group, int threads) {
    if (R <= 0 || K <= 0 || N <= 0 || group <= 0 || group % BLOCK || K % group) return 1;
    if (sz_dtype == 0)
        int4_run(x, p, static_cast<const float*>(sz), y, R, K, N, group, threads);
    else if (sz_dtype == 1)
        int4_run(x, p, static_cast<const uint16_t*>(sz), y, R, K, N, group, threads);
    else
        return 2;
    return 0;
}
}

#else  // no AVX2 + FMA: nothing to offer; models/native.py sees the missing symbol and keeps PyTorch's kernels
extern "C" int meshlm_quant_rows_missing() { return 1; }
#endif
