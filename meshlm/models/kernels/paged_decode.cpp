// Decoding attention read in place from the paged KV pool (models/native.py builds and loads this file).
//
// R rows of one query each; row r sees its first lens[r] positions, position p held in the pool's slot
// table[r][p / bs] * bs + p % bs. The pool is head-major, (nkv, slots, hd), as models/paged.py keeps it. Each KV
// head's `group` query heads read its keys and values once: a pass over the row's positions in tiles, scores
// in fp32, an online softmax (running maximum and sum, the accumulator rescaled when the maximum grows), the
// values summed in fp32. Work items are (row, KV head, chunk of positions): with fewer (row, KV head) pairs than 8
// a thread a row's positions are split into chunks, each with its own maximum and sum, merged at the end as
// split-K decoding attention does. A position's slot comes from its block and offset, stepped along a tile, not
// divided out per position (that 64-bit division, with the tile's scalar maximum, cost a quarter to a third of
// the kernel's time). A tile's values are asked for (prefetched) while its keys are read: the pool's blocks lie
// apart, so the hardware prefetcher sees runs of one block at most, and without it each value row waited on the
// cache after the softmax (a third of a bf16 call, more on the portable path). `meshlm_paged_write`
// writes a step's new keys and values into their slots before the layer attends.
// Plain C++ (no PyTorch headers): loaded with ctypes, compiled with the same compiler and OpenMP runtime that
// PyTorch's Inductor uses, so its parallel region runs on the process's one OpenMP pool.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int TILE = 64;      // positions scored before their values are summed
constexpr int MAX_GROUP = 16; // query heads per KV head
constexpr int MAX_HD = 256;   // head width

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch's cast
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 within 2 ulp of expf, written so that the compiler vectorizes it: x = n ln2 + r, |r| <= ln2/2,
// e^r by its Taylor polynomial to degree 6, 2^n into the exponent's bits
inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = std::nearbyint(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, 4);
    return p * scale;
}

// A work item's start: no maximum yet, an empty sum, the accumulator (group, hd) zero.
inline void begin_item(int group, int64_t hd, float* acc, float* m, float* l) {
    for (int j = 0; j < group; ++j) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        for (int64_t d = 0; d < hd; ++d) acc[j * hd + d] = 0.0f;
    }
}

// The online softmax over one tile: each query head j's scores s[j][0..n) become weights exp(s - m[j]) against its
// running maximum m[j] (raised to the tile's), its running sum l[j] and its accumulated values acc (group, hd)
// rescaled to that maximum.
inline void softmax_tile(float (*s)[TILE], int group, int n, float* m, float* l, float* acc, int64_t hd) {
    for (int j = 0; j < group; ++j) {
        float top = m[j];
#pragma omp simd reduction(max : top)
        for (int i = 0; i < n; ++i) top = s[j][i] > top ? s[j][i] : top;
        const float shrink = m[j] == -INFINITY ? 0.0f : exp_neg(m[j] - top);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < n; ++i) {
            s[j][i] = exp_neg(s[j][i] - top);
            sum += s[j][i];
        }
        l[j] = l[j] * shrink + sum;
        m[j] = top;
        if (shrink != 1.0f) {
            float* a = acc + j * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) a[d] *= shrink;
        }
    }
}

template <typename P>
inline float load(const P* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// One key or value row (hd values) asked for before it is read: a tile's values are read after its keys' softmax,
// so they are asked for while the keys are read, and the loads of a tile overlap instead of waiting one by one on
// the cache (the pool's blocks lie apart, so the hardware's prefetcher sees runs of at most one block).
template <typename P>
inline void prefetch_row(const P* p, int64_t hd) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(P)); b += 64) __builtin_prefetch(c + b, 0, 3);
}

// One work item: KV head h of row r over positions [p0, p1). q: the group's queries (group, hd), already scaled.
// Leaves the unnormalized sum of values in acc (group, hd), the running maximum in m and the sum in l.
template <typename P>
void attend_chunk(const float* q, const P* kpool, const P* vpool, const int64_t* table, int64_t h,
                  int64_t slots, int64_t hd, int64_t bs, int group, int64_t p0, int64_t p1, float* acc, float* m,
                  float* l) {
    float s[MAX_GROUP][TILE];
    float row[MAX_HD];  // one key or value row in fp32
    begin_item(group, hd, acc, m, l);
    const P* kh = kpool + h * slots * hd;
    const P* vh = vpool + h * slots * hd;
    for (int64_t t0 = p0; t0 < p1; t0 += TILE) {
        const int n = static_cast<int>(p1 - t0 < TILE ? p1 - t0 : TILE);
        for (int64_t i = 0, b = t0 / bs, off = t0 % bs; i < n; ++i, off = off + 1 == bs ? 0 : off + 1, b += off == 0) {
            const P* k = kh + (table[b] * bs + off) * hd;
            prefetch_row(vh + (table[b] * bs + off) * hd, hd);
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) row[d] = load(k, d);  // widened once for the group's heads
            for (int j = 0; j < group; ++j) {
                const float* qj = q + j * hd;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < hd; ++d) dot += qj[d] * row[d];
                s[j][i] = dot;
            }
        }
        softmax_tile(s, group, n, m, l, acc, hd);
        for (int64_t i = 0, b = t0 / bs, off = t0 % bs; i < n; ++i, off = off + 1 == bs ? 0 : off + 1, b += off == 0) {
            const P* v = vh + (table[b] * bs + off) * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) row[d] = load(v, d);
            for (int j = 0; j < group; ++j) {
                const float w = s[j][i];
                float* a = acc + j * hd;
#pragma omp simd
                for (int64_t d = 0; d < hd; ++d) a[d] += w * row[d];
            }
        }
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The same work item in SIMD registers of W fp32 lanes (AVX-512: 16, AVX2 with FMA: 8), for heads of NC × W values:
// each tile's keys and values widened to fp32 once (bf16) or read where they lie (fp32); a head's scores W positions
// at a time, the W dot products' lanes summed together (`Vec::reduce`) rather than one by one; a head's
// accumulator held in registers across a tile's values.
#ifdef __AVX512F__
struct Vec {
    using T = __m512;
    static constexpr int W = 16;
    static T zero() { return _mm512_setzero_ps(); }
    static T set1(float x) { return _mm512_set1_ps(x); }
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static T load(const uint16_t* p) {
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    }
    static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
    static void store_aligned(float* p, T v) { _mm512_store_ps(p, v); }
    static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
    // lane i of the result: the sum of v[i]'s 16 lanes (pairs within 128-bit lanes, then across them)
    static T reduce(const T* v) {
        T x[8], y[4], z[2];
        for (int i = 0; i < 8; ++i)
            x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
        for (int i = 0; i < 4; ++i)
            y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
        for (int i = 0; i < 2; ++i)
            z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
        return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
    }
};
#else
struct Vec {
    using T = __m256;
    static constexpr int W = 8;
    static T zero() { return _mm256_setzero_ps(); }
    static T set1(float x) { return _mm256_set1_ps(x); }
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static T load(const uint16_t* p) {
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    }
    static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
    static void store_aligned(float* p, T v) { _mm256_store_ps(p, v); }
    static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    // lane i of the result: the sum of v[i]'s 8 lanes (pairwise sums twice, then the two 128-bit halves)
    static T reduce(const T* v) {
        const T a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        const T b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
};
#endif

template <int NC, typename P>
void attend_chunk_simd(const float* q, const P* kpool, const P* vpool, const int64_t* table, int64_t h,
                       int64_t slots, int64_t bs, int group, int64_t p0, int64_t p1, float* acc, float* m,
                       float* l) {
    using V = typename Vec::T;
    constexpr int W = Vec::W;
    constexpr int HD = NC * W;
    alignas(64) float s[MAX_GROUP][TILE];
    alignas(64) float wide[TILE * HD];  // a bf16 tile's rows in fp32
    const float* rows[TILE];
    begin_item(group, HD, acc, m, l);
    const P* kh = kpool + h * slots * HD;
    const P* vh = vpool + h * slots * HD;
    // the tile's rows, as fp32 pointers; with the keys, the same positions' values asked for (`prefetch_row`), and
    // fp32 keys, read where they lie, asked for before the products read them
    auto widen = [&](const P* base, int64_t t0, int n) {
        int64_t b = t0 / bs, off = t0 % bs;  // the tile's first block and offset: no division per position
        for (int i = 0; i < n; ++i) {
            const P* src = base + (table[b] * bs + off) * HD;
            if (base == kh) {
                prefetch_row(vh + (table[b] * bs + off) * HD, HD);
                if constexpr (sizeof(P) == 4) prefetch_row(src, HD);
            }
            if (++off == bs) {
                off = 0;
                ++b;
            }
            if constexpr (sizeof(P) == 4) {
                rows[i] = reinterpret_cast<const float*>(src);
            } else {
                for (int c = 0; c < NC; ++c) Vec::store_aligned(wide + i * HD + c * W, Vec::load(src + c * W));
                rows[i] = wide + i * HD;
            }
        }
    };
    for (int64_t t0 = p0; t0 < p1; t0 += TILE) {
        const int n = static_cast<int>(p1 - t0 < TILE ? p1 - t0 : TILE);
        widen(kh, t0, n);
        for (int j = 0; j < group; ++j) {
            V qv[NC];
            for (int c = 0; c < NC; ++c) qv[c] = Vec::load(q + j * HD + c * W);
            for (int i0 = 0; i0 < n; i0 += W) {
                V dots[W];
                for (int i = 0; i < W; ++i) {
                    V a = Vec::zero();
                    if (i0 + i < n)
                        for (int c = 0; c < NC; ++c) a = Vec::fmadd(qv[c], Vec::load(rows[i0 + i] + c * W), a);
                    dots[i] = a;
                }
                Vec::store_aligned(&s[j][i0], Vec::reduce(dots));
            }
        }
        softmax_tile(s, group, n, m, l, acc, HD);
        widen(vh, t0, n);
        for (int j = 0; j < group; ++j) {
            V av[NC];
            float* a = acc + j * HD;
            for (int c = 0; c < NC; ++c) av[c] = Vec::load(a + c * W);
            for (int i = 0; i < n; ++i) {
                const V w = Vec::set1(s[j][i]);
                for (int c = 0; c < NC; ++c) av[c] = Vec::fmadd(w, Vec::load(rows[i] + c * W), av[c]);
            }
            for (int c = 0; c < NC; ++c) Vec::store(a + c * W, av[c]);
        }
    }
}
#endif

// The work item through the widest path this build has for heads of `hd` values.
template <typename P>
void attend_item(const float* q, const P* kpool, const P* vpool, const int64_t* table, int64_t h, int64_t slots,
                 int64_t hd, int64_t bs, int group, int64_t p0, int64_t p1, float* acc, float* m, float* l) {
#if defined(__AVX512F__)
    if (hd == 64) return attend_chunk_simd<4>(q, kpool, vpool, table, h, slots, bs, group, p0, p1, acc, m, l);
    if (hd == 128) return attend_chunk_simd<8>(q, kpool, vpool, table, h, slots, bs, group, p0, p1, acc, m, l);
    if (hd == 32) return attend_chunk_simd<2>(q, kpool, vpool, table, h, slots, bs, group, p0, p1, acc, m, l);
#elif defined(__AVX2__) && defined(__FMA__)
    if (hd == 64) return attend_chunk_simd<8>(q, kpool, vpool, table, h, slots, bs, group, p0, p1, acc, m, l);
    if (hd == 128) return attend_chunk_simd<16>(q, kpool, vpool, table, h, slots, bs, group, p0, p1, acc, m, l);
    if (hd == 32) return attend_chunk_simd<4>(q, kpool, vpool, table, h, slots, bs, group, p0, p1, acc, m, l);
#endif
    attend_chunk(q, kpool, vpool, table, h, slots, hd, bs, group, p0, p1, acc, m, l);
}

template <typename P, typename Q>
void run(const Q* q, int64_t q_row, int64_t q_head, const P* kpool, const P* vpool, const int64_t* table,
         int64_t nb, const int64_t* lens, Q* out, float* lse, int64_t R, int64_t nh, int64_t nkv, int64_t hd,
         int64_t slots, int64_t bs, float scale, int64_t chunk, int threads) {
    const int group = static_cast<int>(nh / nkv);
    // chunks per row: positions split so that every row's longest has at most `chunk` a piece
    int64_t longest = 0;
    for (int64_t r = 0; r < R; ++r) longest = lens[r] > longest ? lens[r] : longest;
    // enough (row, KV head) pairs to keep every thread busy: no split
    const int64_t C = longest <= chunk || R * nkv >= 8 * threads ? 1 : (longest + chunk - 1) / chunk;
    const int64_t span = C == 1 ? longest : chunk;  // positions a work item reads
    const int64_t items = R * nkv * C;
    const int64_t part = group * (hd + 2);  // per item: acc (group, hd), then m (group), l (group)
    static thread_local std::vector<float> scratch;  // reused: a fresh one per call costs page faults
    if (C > 1 && scratch.size() < static_cast<size_t>(items * part)) scratch.resize(items * part);
    float* parts = scratch.data();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t c = it % C, h = (it / C) % nkv, r = it / (C * nkv);
        const int64_t len = lens[r];
        const int64_t p0 = c * span, p1 = (c + 1) * span < len ? (c + 1) * span : len;
        float qf[MAX_GROUP * MAX_HD];
        float local[MAX_GROUP * (MAX_HD + 2)];
        float* acc = C > 1 ? parts + it * part : local;
        float* m = acc + group * hd;
        float* l = m + group;
        if (p0 >= p1) {  // a short row's empty chunk (or an empty row: zeros, log-sum-exp -inf)
            for (int j = 0; j < group; ++j) {
                m[j] = -INFINITY;
                l[j] = 0.0f;
                if (C > 1) continue;
                Q* o = out + (r * nh + h * group + j) * hd;
                for (int64_t d = 0; d < hd; ++d) o[d] = 0;
                if (lse) lse[r * nh + h * group + j] = -INFINITY;
            }
            continue;
        }
        for (int j = 0; j < group; ++j) {
            const Q* qj = q + r * q_row + (h * group + j) * q_head;
            for (int64_t d = 0; d < hd; ++d) qf[j * hd + d] = load(qj, d) * scale;
        }
        attend_item(qf, kpool, vpool, table + r * nb, h, slots, hd, bs, group, p0, p1, acc, m, l);
        if (C == 1) {
            for (int j = 0; j < group; ++j) {
                Q* o = out + (r * nh + h * group + j) * hd;
                if (lse) lse[r * nh + h * group + j] = m[j] + std::log(l[j]);
                const float inv = 1.0f / l[j];
                for (int64_t d = 0; d < hd; ++d) {
                    const float y = acc[j * hd + d] * inv;
                    if constexpr (sizeof(Q) == 2) o[d] = float_to_bf16(y); else o[d] = y;
                }
            }
        }
    }
    if (C == 1) return;
#pragma omp parallel for num_threads(threads)
    for (int64_t rh = 0; rh < R * nkv; ++rh) {  // merge the chunks of (row, KV head) by their maxima and sums
        const int64_t r = rh / nkv, h = rh % nkv;
        const float* base = parts + rh * C * part;
        for (int j = 0; j < group; ++j) {
            float top = -INFINITY;
            for (int64_t c = 0; c < C; ++c) {
                const float mc = base[c * part + group * hd + j];
                top = mc > top ? mc : top;
            }
            float y[MAX_HD] = {0.0f};
            float total = 0.0f;
            for (int64_t c = 0; c < C; ++c) {
                const float* pc = base + c * part;
                const float mc = pc[group * hd + j];
                if (mc == -INFINITY) continue;
                const float w = exp_neg(mc - top);
                total += w * pc[group * hd + group + j];
                for (int64_t d = 0; d < hd; ++d) y[d] += w * pc[j * hd + d];
            }
            Q* o = out + (r * nh + h * group + j) * hd;
            if (lse) lse[r * nh + h * group + j] = total > 0.0f ? top + std::log(total) : -INFINITY;
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t d = 0; d < hd; ++d) {
                if constexpr (sizeof(Q) == 2) o[d] = float_to_bf16(y[d] * inv); else o[d] = y[d] * inv;
            }
        }
    }
}

}  // namespace

extern "C" {

// The step's new keys and values into their slots: token t's KV head h from knew + t * k_row + h * k_head (and
// vnew likewise; each head's hd values contiguous) to the pools' slot slots[t] of head h. vpool and vnew null: a
// pool of keys only. elsize: bytes per value (the pools' and the new rows' dtype, the same). What
// `index_copy_` along the pool's slot dimension does, without its strided-copy set-up (tens of microseconds a
// layer when the new rows come as views of the layer's fused projection).
int meshlm_paged_write(const void* knew, int64_t k_row, int64_t k_head, const void* vnew, int64_t v_row,
                       int64_t v_head, void* kpool, void* vpool, const int64_t* slots, int64_t N, int64_t nkv,
                       int64_t hd, int64_t total, int64_t elsize) {
    const int64_t row = hd * elsize;
    for (int64_t t = 0; t < N; ++t)  // every slot checked before any is written
        if (slots[t] < 0 || slots[t] >= total) return 1;
    for (int64_t t = 0; t < N; ++t) {
        for (int64_t h = 0; h < nkv; ++h) {
            std::memcpy(static_cast<char*>(kpool) + (h * total + slots[t]) * row,
                        static_cast<const char*>(knew) + (t * k_row + h * k_head) * elsize, row);
            if (vpool)
                std::memcpy(static_cast<char*>(vpool) + (h * total + slots[t]) * row,
                            static_cast<const char*>(vnew) + (t * v_row + h * v_head) * elsize, row);
        }
    }
    return 0;
}

// The limits a caller checks before calling (models/native.py).
int meshlm_paged_decode_limits(int which) { return which == 0 ? MAX_GROUP : MAX_HD; }

// q (R rows, nh heads, hd) with strides q_row, q_head (elements; each head's hd contiguous); kpool, vpool (nkv,
// slots, hd) contiguous; table (R, nb) contiguous block ids; lens (R) positions each row sees; out (R, nh, hd)
// contiguous; lse, when not null, (R, nh) fp32: each head's log-sum-exp of its scaled scores (to merge the output
// with attention over other keys). dtype: 0 fp32 (q, pool and out), 1 bf16 (all three). chunk: the most
// positions one work item reads.
int meshlm_paged_decode(const void* q, int64_t q_row, int64_t q_head, const void* kpool, const void* vpool,
                        const int64_t* table, int64_t nb, const int64_t* lens, void* out, float* lse, int64_t R,
                        int64_t nh, int64_t nkv, int64_t hd, int64_t slots, int64_t bs, float scale, int64_t chunk,
                        int dtype, int threads) {
    if (nkv <= 0 || nh % nkv != 0 || nh / nkv > MAX_GROUP || hd > MAX_HD || chunk <= 0) return 1;
    if (dtype == 0)
        run(static_cast<const float*>(q), q_row, q_head, static_cast<const float*>(kpool),
            static_cast<const float*>(vpool), table, nb, lens, static_cast<float*>(out), lse, R, nh, nkv, hd, slots,
            bs, scale, chunk, threads);
    else if (dtype == 1)
        run(static_cast<const uint16_t*>(q), q_row, q_head, static_cast<const uint16_t*>(kpool),
            static_cast<const uint16_t*>(vpool), table, nb, lens, static_cast<uint16_t*>(out), lse, R, nh, nkv, hd,
            slots, bs, scale, chunk, threads);
    else
        return 2;
    return 0;
}
}
