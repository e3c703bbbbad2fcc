// Matrix products of a few bf16 activation rows with a bf16 weight, for a CPU with AVX512-BF16 (models/native.py builds
// and loads this file with bf16_ops.cpp; infer/rows.py routes a bf16 model's decoding products here on a CPU whose
// native bf16 is AVX512-BF16 without AMX).
//
// y[r][n] = sum_k x[r][k] w[n][k]: x (R, K) and w (N, K) in bf16, each row contiguous, the sum in fp32 and y rounded to
// bf16 (to nearest even, as oneDNN's bf16 product rounds its fp32 sums). Each step takes 32 inputs of a weight row and
// of an activation row and adds their 16 pair products to 16 fp32 sums with one instruction (`vdpbf16ps`,
// `_mm512_dpbf16_ps`); the row's sums are added at its end; a tail of K (not a multiple of 32) is read through a mask.
// The weight is read once per call: up to 4 rows share every weight vector loaded, 4 output channels a tile; output
// channels are split over the threads in contiguous shares of tiles, each thread asking for the weight rows of the tile
// `AHEAD` tiles on before it reads them (software prefetch; on a 2-core EPYC with AVX512-BF16 any distance from 0 to 16
// tiles read within 10% of the others, 2 the fastest: the hardware's prefetchers follow these contiguous rows well,
// unlike quant_rows.cpp's).
//
// Why: a one-row product is a read of the weight. oneDNN's bf16 product (`F.linear` on bf16 weights) read one SmolLM2
// row's 270 MB at 26 GB/s on a 2-core EPYC with AVX512-BF16 (no AMX) where `torch.sum` reads 36, and Inductor's own C++
// kernel widened each weight to fp32 at 16 GB/s (benchmarks/RESULTS.md, "Every pair on the AVX512-BF16 EPYC after the
// serving rounds"). This one's measurements: RESULTS.md, "bf16 rows of meshlm's own".
//
// `vdpbf16ps` treats bf16 denormals as zero and rounds each pair's sum to fp32 (round to nearest even); the order of
// the sums differs from oneDNN's, so results agree with an fp32 product of the same bf16 values within fp32's rounding
// of the sums and bf16's of the result (tests/infer/test_bf16_rows.py). Plain C++ (no PyTorch headers), compiled with
// the OpenMP runtime PyTorch has loaded, as paged_decode.cpp is.

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int MAX_ROWS = 4;  // rows sharing one weight vector loaded
constexpr int TILE = 4;      // output channels a tile
constexpr int AHEAD = 2;     // a tile asks for the weight rows of the tile this many tiles on

inline void prefetch(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

inline __m512bh as_bf16(__m512i v) { return (__m512bh)v; }  // the same 512 bits, read as 32 bf16

inline void store(float v, uint16_t* y) {  // bf16, to nearest even (a NaN stays a NaN)
    uint32_t bits;
    __builtin_memcpy(&bits, &v, 4);
    *y = (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((bits >> 16) | 0x40u)
                                            : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// NR rows (stride ldx) × NT channels (rows of w, stride K) → y[r * ldy + t].
template <int NR, int NT>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy) {
    __m512 acc[NR][NT];
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[NT];
        for (int t = 0; t < NT; ++t) wv[t] = as_bf16(_mm512_loadu_si512(w + t * K + k));
        for (int r = 0; r < NR; ++r) {
            const __m512bh xv = as_bf16(_mm512_loadu_si512(x + r * ldx + k));
            for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv, wv[t]);
        }
    }
    if (k < K) {  // the last K - k (< 32) inputs; the masked-off lanes are zeros in both operands
        const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
        __m512bh wv[NT];
        for (int t = 0; t < NT; ++t) wv[t] = as_bf16(_mm512_maskz_loadu_epi16(mask, w + t * K + k));
        for (int r = 0; r < NR; ++r) {
            const __m512bh xv = as_bf16(_mm512_maskz_loadu_epi16(mask, x + r * ldx + k));
            for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv, wv[t]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t) store(_mm512_reduce_add_ps(acc[r][t]), y + r * ldy + t);
}

template <int NT>
void rows_block(int nr, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy) {
    switch (nr) {
        case 1: tile<1, NT>(x, ldx, w, K, y, ldy); break;
        case 2: tile<2, NT>(x, ldx, w, K, y, ldy); break;
        case 3: tile<3, NT>(x, ldx, w, K, y, ldy); break;
        default: tile<4, NT>(x, ldx, w, K, y, ldy); break;
    }
}

}  // namespace

extern "C" {

// x (R, K) bf16, row r at x + r * ldx; w (N, K) bf16 contiguous; y (R, N) bf16 contiguous. 0, or 1 for a bad size.
int meshlm_bf16_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t R, int64_t K, int64_t N,
                     int threads) {
    if (R <= 0 || K <= 0 || N <= 0 || ldx < K) return 1;
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = tiles * me / team, hi = tiles * (me + 1) / team;
        if (hi > lo) {
            const int64_t first = lo * TILE, count = (hi - lo < AHEAD ? hi - lo : AHEAD) * TILE;
            prefetch(w + first * K, (N - first < count ? N - first : count) * K * 2);
        }
        for (int64_t i = lo; i < hi; ++i) {
            const int64_t n = i * TILE, width = N - n < TILE ? N - n : TILE;
            const int64_t ahead = n + AHEAD * TILE;  // within this thread's share: the next thread asks for its own
            if (i + AHEAD < hi) prefetch(w + ahead * K, (N - ahead < TILE ? N - ahead : TILE) * K * 2);
            for (int64_t r = 0; r < R; r += MAX_ROWS) {
                const int nr = static_cast<int>(R - r < MAX_ROWS ? R - r : MAX_ROWS);
                if (width == TILE)
                    rows_block<TILE>(nr, x + r * ldx, ldx, w + n * K, K, y + r * N + n, N);
                else
                    for (int64_t c = n; c < n + width; ++c)
                        rows_block<1>(nr, x + r * ldx, ldx, w + c * K, K, y + r * N + c, N);
            }
        }
    }
    return 0;
}
}

#else  // no AVX512-BF16: models/native.py sees the missing symbol and keeps F.linear
extern "C" int meshlm_bf16_rows_missing() { return 1; }
#endif
