/* The kernels of the direct allreduce over a shared window (``gradcoll.algorithms._direct_c``): the exact
 * reduction of ``gradcoll.kernels.exact_reference`` (the same bits as ``exact_reduce``), AVX2 and AVX-512,
 * the bf16/fp16 encode, decode and wire reduction (the rules of ``lowp_reference``), and the aligned bulk
 * copy into and out of the slots. Pure computation: no I/O, no Python; ``_fused.h`` supplies the shared
 * loops and the SIMD dispatch. Built into the extension that includes it (``-ffp-contract=off``).
 */
#ifndef GRADCOLL_WINDOW_KERNELS_H
#define GRADCOLL_WINDOW_KERNELS_H

#include "_fused.h"
#include <math.h>
#include <stdint.h>
#include <string.h>
#define GCD_BLOCK 2048
/* The loops below are built twice, for AVX2 and the baseline, the faster picked at load time (as in
   gradcoll.kernels' _fused.h). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define GCD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GCD_CLONES
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
/* memcpy for the bulk copies into and out of the slots. The C library's memcpy of a large block, on some
   x86 cores (AMD Zen), runs at a tenth of its speed when the destination sits 16 bytes past a 64-byte
   boundary while the source is aligned ("rep movsb" with that misalignment) -- exactly where the data of
   a large NumPy array starts (16 bytes into a page). This loop stores aligned 16-byte words, whatever the
   two alignments, at memcpy's full speed otherwise. */
static void gcd_copy(char* d, const char* s, size_t n) {
#if defined(__SSE2__)
    if (n < 256) { memcpy(d, s, n); return; }
    size_t head = (16 - ((uintptr_t)d & 15)) & 15, i;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    for (i = 0; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i*)(s + i)), b = _mm_loadu_si128((const __m128i*)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i*)(s + i + 32)), e = _mm_loadu_si128((const __m128i*)(s + i + 48));
        _mm_store_si128((__m128i*)(d + i), a); _mm_store_si128((__m128i*)(d + i + 16), b);
        _mm_store_si128((__m128i*)(d + i + 32), c); _mm_store_si128((__m128i*)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}
static const double GCD_MAGIC = 6755399441055744.0;  /* 1.5 * 2**52: (y + M) - M rounds y half to even */
static inline double gcd_bits(int64_t b) { double d; memcpy(&d, &b, 8); return d; }

/* exact reduction (gradcoll.kernels.exact_reference), float32 contributions */
GCD_CLONES static int gcd_exact_f32(const float* const* xs, int n, int64_t m, float* out, double div, double recip,
                         double limit, int64_t hi, int64_t lo, int64_t bmin) {
    int bad = 0;
    if (n == 2) {
        for (int64_t i = 0; i < m; i++) {
            double r = (double)xs[0][i] + (double)xs[1][i];
            r = recip > 0 ? r * recip : r / div;
            out[i] = (float)r;
            bad |= !(fabs(r) < limit);
        }
        return bad;
    }
    uint32_t mb[GCD_BLOCK];
    double acc[GCD_BLOCK], plain[GCD_BLOCK];
    for (int64_t i0 = 0; i0 < m; i0 += GCD_BLOCK) {
        int64_t w = m - i0 < GCD_BLOCK ? m - i0 : GCD_BLOCK;
        for (int64_t j = 0; j < w; j++) { uint32_t u; memcpy(&u, &xs[0][i0 + j], 4); mb[j] = u & 0x7FFFFFFFu; }
        for (int r = 1; r < n; r++)
            for (int64_t j = 0; j < w; j++) {
                uint32_t u; memcpy(&u, &xs[r][i0 + j], 4); u &= 0x7FFFFFFFu; mb[j] = u > mb[j] ? u : mb[j];
            }
        for (int r = 0; r < n; r++)
            for (int64_t j = 0; j < w; j++) {
                int64_t b = (int64_t)(mb[j] >> 23); if (b < bmin) b = bmin;
                double sc = gcd_bits((hi - b) << 52), x = (double)xs[r][i0 + j];
                double y = (x * sc + GCD_MAGIC) - GCD_MAGIC;
                if (r == 0) { acc[j] = y; plain[j] = x; } else { acc[j] += y; plain[j] += x; }
            }
        for (int64_t j = 0; j < w; j++) {
            int64_t b = (int64_t)(mb[j] >> 23), be = b < bmin ? bmin : b;
            double res = (b == 0xFF || mb[j] == 0) ? plain[j] : acc[j] * gcd_bits((be + lo) << 52);
            double r = recip > 0 ? res * recip : res / div;
            out[i0 + j] = (float)r;
            bad |= !(fabs(r) < limit);
        }
    }
    return bad;
}

/* the same for float64 contributions */
GCD_CLONES static int gcd_exact_f64(const double* const* xs, int n, int64_t m, double* out, double div, double recip,
                         double limit, int64_t hi, int64_t lo, int64_t bmin) {
    int bad = 0;
    if (n == 2) {
        for (int64_t i = 0; i < m; i++) {
            double r = xs[0][i] + xs[1][i];
            r = recip > 0 ? r * recip : r / div;
            out[i] = r;
            bad |= !(fabs(r) < limit);
        }
        return bad;
    }
    uint64_t mb[GCD_BLOCK];
    double acc[GCD_BLOCK], plain[GCD_BLOCK];
    for (int64_t i0 = 0; i0 < m; i0 += GCD_BLOCK) {
        int64_t w = m - i0 < GCD_BLOCK ? m - i0 : GCD_BLOCK;
        for (int64_t j = 0; j < w; j++) { uint64_t u; memcpy(&u, &xs[0][i0 + j], 8); mb[j] = u & 0x7FFFFFFFFFFFFFFFull; }
        for (int r = 1; r < n; r++)
            for (int64_t j = 0; j < w; j++) {
                uint64_t u; memcpy(&u, &xs[r][i0 + j], 8); u &= 0x7FFFFFFFFFFFFFFFull; mb[j] = u > mb[j] ? u : mb[j];
            }
        for (int r = 0; r < n; r++)
            for (int64_t j = 0; j < w; j++) {
                int64_t b = (int64_t)(mb[j] >> 52); if (b < bmin) b = bmin;
                double sc = gcd_bits((hi - b) << 52), x = xs[r][i0 + j];
                double y = (x * sc + GCD_MAGIC) - GCD_MAGIC;
                if (r == 0) { acc[j] = y; plain[j] = x; } else { acc[j] += y; plain[j] += x; }
            }
        for (int64_t j = 0; j < w; j++) {
            int64_t b = (int64_t)(mb[j] >> 52), be = b < bmin ? bmin : b;
            double res = (b == 0x7FF || mb[j] == 0) ? plain[j] : acc[j] * gcd_bits((be + lo) << 52);
            double r = recip > 0 ? res * recip : res / div;
            out[i0 + j] = r;
            bad |= !(fabs(r) < limit);
        }
    }
    return bad;
}

/* The exact reduction of n > 2 float32 contributions, 8 elements at a time (AVX2). An element none of
   whose nonzero contributions lies more than F - 24 binades below its largest has every contribution on
   its grid already (step 2 rounds nothing), so its exact integer sum is the float64 sum of the
   contributions in any order, and so is an element with an Inf/NaN or only zeros (the special cases,
   summed in float64 by the block form too): such elements take the float64 sum in rank order. A group
   of 8 with any other element goes through the grid, vectorised; the tail through the block form. The
   operations are the block form's, so are the bits. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#include <immintrin.h>
#define GCD_EXACT_AVX2 1
#define GCD_EXACT_NMAX 64  /* (MAXN) */
/* Enter FN (an always-inlined loop) with n a constant for 3 to 8 contributions */
#define GCD_WITH_N(FN)                                                                                 \
    switch (n) {                                                                                       \
    case 3: return FN(xs, 3, m, out, div, recip, limit, hi, lo, bmin, F);                              \
    case 4: return FN(xs, 4, m, out, div, recip, limit, hi, lo, bmin, F);                              \
    case 5: return FN(xs, 5, m, out, div, recip, limit, hi, lo, bmin, F);                              \
    case 6: return FN(xs, 6, m, out, div, recip, limit, hi, lo, bmin, F);                              \
    case 7: return FN(xs, 7, m, out, div, recip, limit, hi, lo, bmin, F);                              \
    case 8: return FN(xs, 8, m, out, div, recip, limit, hi, lo, bmin, F);                              \
    default: return FN(xs, n, m, out, div, recip, limit, hi, lo, bmin, F);                             \
    }
/* The 8 elements at i of the n contributions: their float64 sums in rank order (s0: the first 4, s1: the
   rest), and each contribution's bits shifted left once (the sign dropped) folded into mx by an unsigned
   maximum (the largest magnitude's) and, less one, into mn by an unsigned minimum (the smallest nonzero
   magnitude's: a zero becomes the largest) */
__attribute__((target("avx2"), always_inline)) static inline void gcd_x8(
        const float* const* p, const int n, int64_t i, __m256i* mx, __m256i* mn, __m256d* s0, __m256d* s1) {
    const __m256i one = _mm256_set1_epi32(1);
    for (int r = 0; r < n; r++) {
        __m256i u = _mm256_loadu_si256((const __m256i*)(p[r] + i));
        __m256d a0 = _mm256_cvtps_pd(_mm_loadu_ps(p[r] + i)), a1 = _mm256_cvtps_pd(_mm_loadu_ps(p[r] + i + 4));
        u = _mm256_add_epi32(u, u);
        *mx = _mm256_max_epu32(*mx, u);
        *mn = _mm256_min_epu32(*mn, _mm256_sub_epi32(u, one));
        *s0 = r ? _mm256_add_pd(*s0, a0) : a0;
        *s1 = r ? _mm256_add_pd(*s1, a1) : a1;
    }
}
__attribute__((target("avx2"), always_inline)) static inline int gcd_exact_f32_avx2_n(
        const float* const* xs, const int n, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin, int64_t F) {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i span = _mm256_set1_epi32((int)(F - 23)), top = _mm256_set1_epi32(0xFF);
    const __m256i bm = _mm256_set1_epi32((int)bmin), zero = _mm256_setzero_si256();
    const __m256d lim = _mm256_set1_pd(limit), rc = _mm256_set1_pd(recip), dv = _mm256_set1_pd(div);
    const __m256i hv = _mm256_set1_epi64x(hi), lv = _mm256_set1_epi64x(lo);
    const __m256d magic = _mm256_set1_pd(GCD_MAGIC);
    const __m256d mag = _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MAX));
    const int mul = recip > 0;
    const float* p[GCD_EXACT_NMAX];  /* (n a constant: the pointers stay in registers) */
    for (int r = 0; r < n; r++) p[r] = xs[r];
    __m256d flag = _mm256_setzero_pd();
    int bad = 0;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        __m256i mx = zero, mn = _mm256_set1_epi32(-1);
        __m256d s0, s1;
        gcd_x8(p, n, i, &mx, &mn, &s0, &s1);
        __m256i b = _mm256_srli_epi32(mx, 24);
        __m256i bx = _mm256_max_epi32(b, bm);  /* E's clamp */
        __m256i bn = _mm256_max_epi32(_mm256_srli_epi32(_mm256_add_epi32(mn, one), 24), one);  /* subnormals: 1 */
        __m256i special = _mm256_or_si256(_mm256_cmpeq_epi32(b, top), _mm256_cmpeq_epi32(mx, zero));
        __m256i ok = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_add_epi32(bn, span), bx), special);
        if (__builtin_expect(_mm256_movemask_epi8(ok) != -1, 0)) {  /* the grid (steps 2-4), for all 8 */
            __m256i e0 = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(bx));
            __m256i e1 = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(bx, 1));
            __m256d c0 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_sub_epi64(hv, e0), 52));
            __m256d c1 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_sub_epi64(hv, e1), 52));
            __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
            for (int r = 0; r < n; r++) {
                __m256d y0 = _mm256_sub_pd(_mm256_add_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(p[r] + i)), c0), magic), magic);
                __m256d y1 = _mm256_sub_pd(_mm256_add_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(p[r] + i + 4)), c1), magic), magic);
                a0 = r ? _mm256_add_pd(a0, y0) : y0;
                a1 = r ? _mm256_add_pd(a1, y1) : y1;
            }
            a0 = _mm256_mul_pd(a0, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(e0, lv), 52)));
            a1 = _mm256_mul_pd(a1, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(e1, lv), 52)));
            s0 = _mm256_blendv_pd(a0, s0, _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(special))));
            s1 = _mm256_blendv_pd(a1, s1, _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(special, 1))));
        }
        s0 = mul ? _mm256_mul_pd(s0, rc) : _mm256_div_pd(s0, dv);
        s1 = mul ? _mm256_mul_pd(s1, rc) : _mm256_div_pd(s1, dv);
        _mm_storeu_ps(out + i, _mm256_cvtpd_ps(s0));
        _mm_storeu_ps(out + i + 4, _mm256_cvtpd_ps(s1));
        flag = _mm256_or_pd(flag, _mm256_or_pd(_mm256_cmp_pd(_mm256_and_pd(s0, mag), lim, _CMP_NLT_UQ),
                                               _mm256_cmp_pd(_mm256_and_pd(s1, mag), lim, _CMP_NLT_UQ)));
    }
    if (i < m) {
        const float* t[GCD_EXACT_NMAX];
        for (int r = 0; r < n; r++) t[r] = p[r] + i;
        bad |= gcd_exact_f32(t, n, m - i, out + i, div, recip, limit, hi, lo, bmin);
    }
    return bad | (_mm256_movemask_pd(flag) != 0);
}
/* Entered with n a constant for 3 to 8 contributions, as the plain reduce is: the loop
   over the contributions unrolled, their pointers in registers (n known only at run time also takes
   three more integer operations per contribution for the magnitudes). */
__attribute__((target("avx2"))) static int gcd_exact_f32_avx2(
        const float* const* xs, int n, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin, int64_t F) {
    GCD_WITH_N(gcd_exact_f32_avx2_n)
}
/* The same in blocks of GCD_XBLK elements, the test once per block: each lane keeps the largest magnitude
   and the smallest nonzero one over the block's elements in that lane, and the block passes when, in every
   lane, those two are within the span, so every element of the block is within it (its largest no larger,
   its smallest nonzero no smaller). Then its float64 sums are its results; a block that fails (a
   contribution far below, an Inf or a NaN: an exponent of all ones) is done again by the per-element loop
   above. On a passing block no sum is NaN, so the finite check keeps the largest |result| (a maximum)
   and compares it once (docs/algorithms/deterministic.md).
   Each block asks for the lines of the block two on (GCD_XPF elements, 512 bytes) of every contribution
   first. In the direct allreduce the other ranks' slots were just written by other cores: without the
   prefetch the loop's instructions waited on those lines instead of overlapping them; two blocks ahead
   is near enough to arrive in time and far enough not to evict what is still being read. */
#define GCD_XBLK 64
#define GCD_XPF 128
__attribute__((target("avx2"), always_inline)) static inline int gcd_exact_f32_blk_n(
        const float* const* xs, const int n, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin, int64_t F) {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i span = _mm256_set1_epi32((int)(F - 23));
    const __m256i bm = _mm256_set1_epi32((int)bmin);
    const __m256d rc = _mm256_set1_pd(recip), dv = _mm256_set1_pd(div);
    const __m256d mag = _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MAX));
    const int mul = recip > 0;
    const float* p[GCD_EXACT_NMAX];
    for (int r = 0; r < n; r++) p[r] = xs[r];
    int bad = 0;
    int64_t i = 0;
    for (; i + GCD_XBLK <= m; i += GCD_XBLK) {
        __m256i bmx = _mm256_setzero_si256(), bmn = _mm256_set1_epi32(-1);
        __m256d fmx = _mm256_setzero_pd();
        if (i + GCD_XPF + GCD_XBLK <= m) {  /* the block GCD_XPF elements on, of every contribution */
            for (int r = 0; r < n; r++) {
                const char* q = (const char*)(p[r] + i + GCD_XPF);
                _mm_prefetch(q, _MM_HINT_T0);
                _mm_prefetch(q + 64, _MM_HINT_T0);
                _mm_prefetch(q + 128, _MM_HINT_T0);
                _mm_prefetch(q + 192, _MM_HINT_T0);
            }
        }
        for (int64_t j = i; j < i + GCD_XBLK; j += 8) {
            __m256d s0, s1;
            gcd_x8(p, n, j, &bmx, &bmn, &s0, &s1);
            s0 = mul ? _mm256_mul_pd(s0, rc) : _mm256_div_pd(s0, dv);
            s1 = mul ? _mm256_mul_pd(s1, rc) : _mm256_div_pd(s1, dv);
            _mm_storeu_ps(out + j, _mm256_cvtpd_ps(s0));
            _mm_storeu_ps(out + j + 4, _mm256_cvtpd_ps(s1));
            fmx = _mm256_max_pd(fmx, _mm256_max_pd(_mm256_and_pd(s0, mag), _mm256_and_pd(s1, mag)));
        }
        /* per lane: every element's largest exponent at most the block's, its smallest nonzero at least the
           block's; an Inf/NaN (exponent 0xFF) fails here, so fmx is never NaN on a block that passes */
        __m256i bx = _mm256_max_epi32(_mm256_srli_epi32(bmx, 24), bm);
        __m256i bn = _mm256_max_epi32(_mm256_srli_epi32(_mm256_add_epi32(bmn, one), 24), one);
        __m256i ok = _mm256_cmpgt_epi32(_mm256_add_epi32(bn, span), bx);
        if (__builtin_expect(_mm256_movemask_epi8(ok) != -1, 0)) {
            const float* t[GCD_EXACT_NMAX];
            for (int r = 0; r < n; r++) t[r] = p[r] + i;
            bad |= gcd_exact_f32_avx2_n(t, n, GCD_XBLK, out + i, div, recip, limit, hi, lo, bmin, F);
        } else {
            bad |= _mm256_movemask_pd(_mm256_cmp_pd(fmx, _mm256_set1_pd(limit), _CMP_NLT_UQ)) != 0;
        }
    }
    if (i < m) {
        const float* t[GCD_EXACT_NMAX];
        for (int r = 0; r < n; r++) t[r] = p[r] + i;
        bad |= gcd_exact_f32_avx2_n(t, n, m - i, out + i, div, recip, limit, hi, lo, bmin, F);
    }
    return bad;
}
__attribute__((target("avx2"))) static int gcd_exact_f32_blk(
        const float* const* xs, int n, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin, int64_t F) {
    GCD_WITH_N(gcd_exact_f32_blk_n)
}
/* The same on 16 elements at a time (AVX-512 F): the AVX2 loop's operations, in the same order, on
   twice the lanes; the AVX2 loop does the rest. */
__attribute__((target("avx512f,avx512bw,avx2"), always_inline)) static inline int gcd_exact_f32_512_n(
        const float* const* xs, const int n, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin, int64_t F) {
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
    const __m512i span = _mm512_set1_epi32((int)(F - 23)), top = _mm512_set1_epi32(0xFF);
    const __m512i bm = _mm512_set1_epi32((int)bmin), zero = _mm512_setzero_si512();
    const __m512d lim = _mm512_set1_pd(limit), rc = _mm512_set1_pd(recip), dv = _mm512_set1_pd(div);
    const __m512i hv = _mm512_set1_epi64(hi), lv = _mm512_set1_epi64(lo);
    const __m512d magic = _mm512_set1_pd(GCD_MAGIC);
    const __m512i mag = _mm512_set1_epi64(INT64_MAX);
    const int mul = recip > 0;
    const float* p[GCD_EXACT_NMAX];
    for (int r = 0; r < n; r++) p[r] = xs[r];
    int bad = 0;
    int64_t i = 0;
#define GCD_LO8(v) _mm512_castsi512_si256(v)
#define GCD_HI8(v) _mm512_extracti64x4_epi64(v, 1)
#define GCD_PD(v) _mm512_cvtps_pd(_mm256_castsi256_ps(v))
    for (; i + 16 <= m; i += 16) {
        __m512i mx = _mm512_and_si512(_mm512_loadu_si512((const void*)(p[0] + i)), absm);
        /* the smallest nonzero magnitude: a masked minimum over the nonzero ones (none: it stays all ones) */
        __m512i mn = _mm512_mask_mov_epi32(absm, _mm512_test_epi32_mask(mx, mx), mx);
        __m512d s0 = _mm512_cvtps_pd(_mm256_loadu_ps(p[0] + i)), s1 = _mm512_cvtps_pd(_mm256_loadu_ps(p[0] + i + 8));
        for (int r = 1; r < n; r++) {
            __m512i u = _mm512_and_si512(_mm512_loadu_si512((const void*)(p[r] + i)), absm);
            mx = _mm512_max_epi32(mx, u);
            mn = _mm512_mask_min_epi32(mn, _mm512_test_epi32_mask(u, u), mn, u);
            s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm256_loadu_ps(p[r] + i)));
            s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_loadu_ps(p[r] + i + 8)));
        }
        __m512i b = _mm512_srli_epi32(mx, 23);
        __m512i bx = _mm512_max_epi32(b, bm);  /* E's clamp */
        __m512i bn = _mm512_max_epi32(_mm512_srli_epi32(mn, 23), one);  /* subnormals: 1 */
        __mmask16 special = _mm512_cmpeq_epi32_mask(b, top) | _mm512_cmpeq_epi32_mask(mx, zero);
        __mmask16 ok = _mm512_cmpgt_epi32_mask(_mm512_add_epi32(bn, span), bx) | special;
        if (__builtin_expect(ok != 0xFFFF, 0)) {  /* the grid (steps 2-4), for all 16 */
            __m512i e0 = _mm512_cvtepi32_epi64(GCD_LO8(bx)), e1 = _mm512_cvtepi32_epi64(GCD_HI8(bx));
            __m512d c0 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_sub_epi64(hv, e0), 52));
            __m512d c1 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_sub_epi64(hv, e1), 52));
            __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
            for (int r = 0; r < n; r++) {
                __m512i v = _mm512_loadu_si512((const void*)(p[r] + i));
                __m512d y0 = _mm512_sub_pd(_mm512_add_pd(_mm512_mul_pd(GCD_PD(GCD_LO8(v)), c0), magic), magic);
                __m512d y1 = _mm512_sub_pd(_mm512_add_pd(_mm512_mul_pd(GCD_PD(GCD_HI8(v)), c1), magic), magic);
                a0 = r ? _mm512_add_pd(a0, y0) : y0;
                a1 = r ? _mm512_add_pd(a1, y1) : y1;
            }
            a0 = _mm512_mul_pd(a0, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(e0, lv), 52)));
            a1 = _mm512_mul_pd(a1, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(e1, lv), 52)));
            s0 = _mm512_mask_blend_pd((__mmask8)special, a0, s0);
            s1 = _mm512_mask_blend_pd((__mmask8)(special >> 8), a1, s1);
        }
        s0 = mul ? _mm512_mul_pd(s0, rc) : _mm512_div_pd(s0, dv);
        s1 = mul ? _mm512_mul_pd(s1, rc) : _mm512_div_pd(s1, dv);
        _mm256_storeu_ps(out + i, _mm512_cvtpd_ps(s0));
        _mm256_storeu_ps(out + i + 8, _mm512_cvtpd_ps(s1));
        bad |= _mm512_cmp_pd_mask(_mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(s0), mag)), lim, _CMP_NLT_UQ)
             | _mm512_cmp_pd_mask(_mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(s1), mag)), lim, _CMP_NLT_UQ);
    }
#undef GCD_LO8
#undef GCD_HI8
#undef GCD_PD
    if (i < m) {
        const float* t[GCD_EXACT_NMAX];
        for (int r = 0; r < n; r++) t[r] = p[r] + i;
        bad |= gcd_exact_f32_avx2(t, n, m - i, out + i, div, recip, limit, hi, lo, bmin, F);
    }
    return bad != 0;
}
__attribute__((target("avx512f,avx512bw,avx2"))) static int gcd_exact_f32_512(
        const float* const* xs, int n, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin, int64_t F) {
    GCD_WITH_N(gcd_exact_f32_512_n)
}
/* Two float32 contributions: the float64 sum of two float32 values rounds to float32 as their float32
   sum does (exactly when they are within 29 binades, and the smaller cannot move the result past a
   float32 half-way point otherwise), and halving that sum rounds as halving the float64 one does (the
   halving is exact for a sum of exponent 2 or more; a smaller sum was exact already, both operands
   being multiples of the smallest subnormal). So the float32 sum, halved for a mean, has the block
   form's bits wherever it is finite; a group of 8 with a sum beyond float32's range (whose mean may
   be in it) or a NaN takes the block form. */
__attribute__((target("avx2"))) static int gcd_exact2_f32_avx2(
        const float* const* xs, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin) {
    const __m256 f = _mm256_set1_ps((float)recip);
    const __m256i expm = _mm256_set1_epi32(0x7F800000);
    const float *a = xs[0], *b = xs[1];
    int bad = 0;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
        __m256i other = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), expm), expm);
        if (__builtin_expect(!_mm256_testz_si256(other, other), 0)) {
            const float* t[2] = {a + i, b + i};
            bad |= gcd_exact_f32(t, 2, 8, out + i, div, recip, limit, hi, lo, bmin);
            continue;
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, f));
    }
    if (i < m) {
        const float* t[2] = {a + i, b + i};
        bad |= gcd_exact_f32(t, 2, m - i, out + i, div, recip, limit, hi, lo, bmin);
    }
    return bad;
}
/* The same on 32 elements a step (AVX-512 F): one test for both vectors; the AVX2 loop does the rest. */
__attribute__((target("avx512f,avx512bw,avx2"))) static int gcd_exact2_f32_512(
        const float* const* xs, int64_t m, float* out, double div, double recip, double limit,
        int64_t hi, int64_t lo, int64_t bmin) {
    const __m512 f = _mm512_set1_ps((float)recip);
    const __m512i expm = _mm512_set1_epi32(0x7F800000);
    const float *a = xs[0], *b = xs[1];
    int bad = 0;
    int64_t i = 0;
    for (; i + 32 <= m; i += 32) {
        __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i));
        __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16));
        __mmask16 other = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v0), expm), expm)
                        | _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v1), expm), expm);
        if (__builtin_expect(other != 0, 0)) {
            const float* t[2] = {a + i, b + i};
            bad |= gcd_exact_f32(t, 2, 32, out + i, div, recip, limit, hi, lo, bmin);
            continue;
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(v0, f));
        _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(v1, f));
    }
    if (i < m) {
        const float* t[2] = {a + i, b + i};
        bad |= gcd_exact2_f32_avx2(t, m - i, out + i, div, recip, limit, hi, lo, bmin);
    }
    return bad;
}
#endif
/* gcd_exact_f32, through the AVX2 loops above where the CPU has it */
static int gcd_exact32(const float* const* xs, int n, int64_t m, float* out, double div, double recip,
                       double limit, int64_t hi, int64_t lo, int64_t bmin) {
    int64_t F = hi - 127 - 1022;  /* exact_reference.params: hi = F + bias + 1022 */
#ifdef GCD_EXACT_AVX2
    int avx2 = gc_simd() >= 1;  /* (AVX2 with F16C: every AVX2 CPU has it) */
    if (n > 2 && gc_simd_fp() >= 2) return gcd_exact_f32_512(xs, n, m, out, div, recip, limit, hi, lo, bmin, F);
    if (n > 2 && avx2) return gcd_exact_f32_blk(xs, n, m, out, div, recip, limit, hi, lo, bmin, F);
    if (n == 2 && gc_simd_fp() >= 2 && (recip == 1.0 || recip == 0.5))
        return gcd_exact2_f32_512(xs, m, out, div, recip, limit, hi, lo, bmin);
    if (n == 2 && avx2 && (recip == 1.0 || recip == 0.5))
        return gcd_exact2_f32_avx2(xs, m, out, div, recip, limit, hi, lo, bmin);
#endif
    (void)F;
    return gcd_exact_f32(xs, n, m, out, div, recip, limit, hi, lo, bmin);
}
/* wire formats (the rules of gradcoll.kernels.lowp_reference, in _fused.h's loops) */
static void gcd_encode(const float* src, uint16_t* dst, int64_t m, int fp16) {
    if (fp16) gc_encode_fp16((const uint32_t*)src, dst, m);
    else gc_encode_bf16((const uint32_t*)src, dst, m);
}
/* (no finite check: the callers check the encoded values. fp16 through vcvtph2ps, which would quiet a
   signalling NaN: what it decodes is a rounding's result, never one, or an input an add then quiets) */
static void gcd_decode(const uint16_t* src, float* dst, int64_t m, int fp16, const float* table) {
    if (fp16) gc_widen_fp16(dst, src, table, m);
    else gc_widen_bf16(dst, src, m);
}
/* sum of n wire inputs in rank order in float32, divided, rounded to the wire into enc (a private block
   when NULL) and widened into dec when not NULL; nonzero when an encoded result is Inf/NaN. Input me is
   the float32 mine when that is not NULL (a rank's own share, rounded to the wire here) */
GCD_CLONES static int gcd_wire_reduce(const uint16_t* const* xs, int n, int64_t m, uint16_t* enc, float* dec,
                                      float div, int dodiv, int fp16, const float* table, const float* mine,
                                      int me) {
    float acc[GCD_BLOCK];
    uint32_t bits[GCD_BLOCK];
    uint16_t own[GCD_BLOCK], wmine[GCD_BLOCK];
    const uint16_t* t[64];  /* (MAXN) */
    uint32_t flag = 0;
    for (int r = 0; r < n; r++) t[r] = xs[r];
    /* a power of two divides as its reciprocal multiplies (the same correctly rounded value, cheaper) */
    int pow2 = frexpf(div, &(int){0}) == 0.5f && isnormal(1.0f / div);
    float dm = pow2 ? 1.0f / div : div;
    int last = pow2 ? GC_MUL : GC_DIV;
#ifdef GCD_EXACT_AVX2
    if (gc_simd() >= 1) {  /* in registers, 16 or 8 lanes a time (fp16: 8); the block form for the tail */
        int64_t done = fp16 ? gc_wire_reduce_fp16_256(xs, n, m, enc, dec, div, dodiv, mine, me, &flag)
                     : gc_simd_fp() >= 2 ? gc_wire_reduce_bf16_512(xs, n, m, enc, dec, div, dodiv, mine, me, &flag)
                                      : gc_wire_reduce_bf16_256(xs, n, m, enc, dec, div, dodiv, mine, me, &flag);
        if (done == m) return flag != 0;
        for (int r = 0; r < n; r++) t[r] = xs[r] + done;
        m -= done;
        if (enc != NULL) enc += done;
        if (dec != NULL) dec += done;
        if (mine != NULL) mine += done;
    }
#endif
    for (int64_t i0 = 0; i0 < m; i0 += GCD_BLOCK) {
        int64_t w = m - i0 < GCD_BLOCK ? m - i0 : GCD_BLOCK;
        const uint16_t* x[64];
        for (int r = 0; r < n; r++) x[r] = t[r] + i0;
        if (mine != NULL) {  /* this rank's share, rounded to the wire as its encode would */
            gcd_encode(mine + i0, wmine, w, fp16);
            x[me] = wmine;
        }
        /* widen input 0, add the others in rank order (the last add divides: (sum + x) / div is the
           sum's division), round to the wire */
        gcd_decode(x[0], acc, w, fp16, table);
        for (int r = 1; r < n; r++) {
            int mode = (dodiv && r == n - 1) ? last : GC_NONE;
            if (fp16) gc_acc_fp16(acc, x[r], table, w, dm, mode, 0);
            else gc_acc_bf16(acc, x[r], w, dm, mode, 0);
        }
        if (dodiv && n == 1) for (int64_t j = 0; j < w; j++) acc[j] = acc[j] / div;
        uint16_t* e = enc != NULL ? enc + i0 : own;
        memcpy(bits, acc, (size_t)w * 4);  /* the sums' bits, as the encoder reads them (no aliasing) */
        flag |= !(fp16 ? gc_encode_fp16(bits, e, w) : gc_encode_bf16(bits, e, w));
        if (dec != NULL) gcd_decode(e, dec + i0, w, fp16, table);
    }
    return flag != 0;
}

#endif /* GRADCOLL_WINDOW_KERNELS_H */
