# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The direct allreduce over a shared window, compiled: a whole batch of pieces in one ``nogil`` call.

``gradcoll.algorithms.direct`` plans the collective (one-shot or two-shot,
the pieces, the descriptor) and calls ``Plan.run`` once per batch of
pieces; everything between, copying in, publishing, waiting, reducing,
publishing and copying out, runs here without the interpreter. The waiting
protocol is the transport's (``gradcoll.transport._window_c``, cimported).
Counters: 0 arrived (a piece is in this rank's slot), 1 reduced (its share
is in its result ring), 2 done (it no longer reads anyone's slot for that
piece). A piece of tick ``t`` sits in ring buffer ``t % depth`` of every
slot; before overwriting one, a rank waits until every rank is done with
tick ``t - depth``.

Kernels: the sums are the n-input fused sum of ``gradcoll.kernels``
(``_fused.h``: the ranks' slots added in rank order 0..n-1 in registers,
then divided once, the finite check folded in); max and min go in
2,048-element blocks with the same branch-free finite check; ``exact`` is the reduction of
``gradcoll.kernels.exact_reference`` (same bits as ``exact_reduce``);
``bf16``/``fp16`` widen the wire values, sum in float32 and round the
result to the wire format once (the rules of ``lowp_reference``).
"""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from gradcoll.transport._window_c cimport (
    H_COUNTERS, H_DESCRIPTORS, H_REPORT, HEADER_BYTES, N_DESCRIPTORS, W_OK, WinC,
    win_fill, win_now, win_publish, win_wait_all,
)

cnp.import_array()

# The kernels of gradcoll.kernels (_fused.h): the n-input fused sum (one pass, every input summed in registers)
# and the bf16/fp16 encode and widening loops (vectorised; F16C for fp16), AVX2 where the CPU has it.
cdef extern from "../kernels/_fused.h" nogil:
    ctypedef Py_ssize_t gc_ssize
    int gc_reduce_ff(const float* const* xs, gc_ssize n, gc_ssize m, float* out, float f, int mode, int nt)
    int gc_reduce_dd(const double* const* xs, gc_ssize n, gc_ssize m, double* out, double f, int mode, int nt)
    int GC_NONE, GC_MUL, GC_DIV
    int gc_set_simd_cap(int cap)
    int gc_set_fp512(int on)

cdef extern from *:
    """
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
    """
    int GCD_BLOCK
    void gcd_copy(char* d, const char* s, size_t n) nogil
    int gcd_exact32(const float* const* xs, int n, int64_t m, float* out, double div, double recip,
                    double limit, int64_t hi, int64_t lo, int64_t bmin) nogil
    int gcd_exact_f64(const double* const* xs, int n, int64_t m, double* out, double div, double recip,
                      double limit, int64_t hi, int64_t lo, int64_t bmin) nogil
    void gcd_encode(const float* src, uint16_t* dst, int64_t m, int fp16) nogil
    void gcd_decode(const uint16_t* src, float* dst, int64_t m, int fp16, const float* table) nogil
    int gcd_wire_reduce(const uint16_t* const* xs, int n, int64_t m, uint16_t* enc, float* dec, float div,
                        int dodiv, int fp16, const float* table, const float* mine, int me) nogil

ctypedef fused real:
    float
    double

cdef enum:
    ARRIVED = 0
    REDUCED = 1
    DONE = 2
    MAXN = 64
    # ops and variants (gradcoll.algorithms.direct names the same numbers)
    OP_MEAN = 0
    OP_SUM = 1
    OP_MAX = 2
    OP_MIN = 3
    OP_GATHER = 4
    OP_BCAST = 5
    V_PLAIN = 0
    V_EXACT = 1
    V_BF16 = 2
    V_FP16 = 3
    # results of run() beyond the window's wait codes (1..5)
    S_DONE = 0
    S_MORE = 16
    S_MISMATCH = 17
    S_NONFINITE = 18
    # the counter a rank publishes once its piece with a non-finite result is whole in its slot
    FILLED = 3


cdef inline bint _block_finite(real* p, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint32_t b32, m32 = 0
    cdef uint64_t b64, m64 = 0
    if real is float:
        for i in range(k):
            memcpy(&b32, &p[i], 4)
            m32 |= ((b32 & 0x7f800000u) + 0x00800000u)
        return (m32 & 0x80000000u) == 0
    else:
        for i in range(k):
            memcpy(&b64, &p[i], 8)
            m64 |= ((b64 & 0x7ff0000000000000ull) + 0x0010000000000000ull)
        return (m64 & 0x8000000000000000ull) == 0


cdef bint _minmax(real** xs, int n, Py_ssize_t m, real* out, bint is_max, bint check) noexcept nogil:
    """Element-wise max (or min) over ``n`` inputs; a NaN anywhere gives NaN (as ``numpy.maximum``).

    The check reads every input, not only the result: an infinity that the max (min) leaves out
    must halt every rank as well.
    """
    cdef Py_ssize_t lo = 0, hi, i, k
    cdef int j
    cdef bint ok = True
    cdef real* o
    cdef real* x
    cdef real a, b
    while lo < m:
        hi = lo + GCD_BLOCK
        if hi > m:
            hi = m
        k = hi - lo
        o = out + lo
        x = xs[0] + lo
        for i in range(k):
            o[i] = x[i]
        for j in range(1, n):
            x = xs[j] + lo
            for i in range(k):
                a = o[i]
                b = x[i]
                if is_max:
                    o[i] = a if (a > b or a != a) else b
                else:
                    o[i] = a if (a < b or a != a) else b
            if check and not _block_finite(x, k):
                ok = False
        if check and not (_block_finite(xs[0] + lo, k) and _block_finite(o, k)):
            ok = False
        lo = hi
    return ok


def simd_level(int cap=-1):
    """The widest vector loops this module's kernels run (2 AVX-512, 1 AVX2, 0 neither), after lowering
    them to at most ``cap`` when it is given (the tests run every level the CPU has; 2 restores them)."""
    return gc_set_simd_cap(cap)


def fp512(int on=-1):
    """Whether this module's 512-bit floating-point loops run (the CPU's default: not on Intel CPUs, see
    ``_fused.h``'s ``gc_fp512``), after setting it to ``on`` (0 or 1) when it is given."""
    return bool(gc_set_fp512(on))


cdef class Plan:
    # (the attributes Runner sets directly are declared here)
    """One collective's plan on one window: geometry, descriptor and progress (see ``direct.py``).

    Built by ``gradcoll.algorithms.direct`` once per call shape and reused;
    ``start`` binds a buffer and a tick, ``run`` advances up to a number of
    pieces and returns ``(status, culprit, piece)``.
    """

    cdef WinC w
    cdef int two, op, variant, f64, check, fp16, dodiv, region, root, scatter, phase, own
    cdef Py_ssize_t count, item, witem, piece, seg, depth, ring, rslot, res_off
    cdef Py_ssize_t bounds[MAXN + 1]
    cdef char* rbase
    cdef Py_ssize_t rstride, roff
    cdef double divisor, recip, limit
    cdef int64_t hi, lo, bmin
    cdef const float* table
    cdef object keep
    cdef unsigned char desc[64]
    # per call
    cdef char* buf
    cdef char* out
    cdef object held
    cdef uint64_t t0
    cdef Py_ssize_t npieces, k, kin
    cdef double deadline
    cdef int wait_index
    cdef uint64_t wait_value

    def __init__(self, layout, double spin_s, int yields, *, bint two, int op, int variant, bint f64, bint check,
                 Py_ssize_t count, Py_ssize_t item, Py_ssize_t witem, Py_ssize_t piece, Py_ssize_t seg,
                 list bounds, Py_ssize_t depth, Py_ssize_t ring, Py_ssize_t rslot, Py_ssize_t res_off,
                 double divisor, double recip, double limit, tuple exact, object table, bytes desc,
                 object region=None, int root=-1, bint scatter=False):
        cdef int q
        win_fill(&self.w, layout)
        self.w.spin_s, self.w.yields = spin_s, yields
        self.two, self.op, self.variant, self.f64, self.check = two, op, variant, f64, check
        self.fp16 = variant == V_FP16
        self.root, self.scatter = root, scatter
        # Two-shot: the share a rank reduces itself is read from its own buffer, never copied into its slot
        # (no peer reads it there); on a wire the reduction rounds it to the wire as it reads it. Not for
        # wire values already (copied as they are) nor for a region (in place).
        self.own = two and region is None and op < OP_GATHER and (variant <= V_EXACT or item == 4)
        self.count, self.item, self.witem, self.piece, self.seg = count, item, witem, piece, seg
        self.depth, self.ring, self.rslot, self.res_off = depth, ring, rslot, res_off
        self.divisor, self.recip, self.limit = divisor, recip, limit
        self.dodiv = op == OP_MEAN
        self.hi, self.lo, self.bmin = exact
        self.keep = (table, region)
        self.table = <const float*>cnp.PyArray_DATA(table) if table is not None else NULL
        if len(bounds) != self.w.n + 1 or self.w.n > MAXN:
            raise ValueError("bounds must have n + 1 entries")
        for q in range(self.w.n + 1):
            self.bounds[q] = bounds[q]
        self.region = region is not None
        if self.region:
            self.rbase = <char*><Py_ssize_t>region[0]
            self.rstride = region[1]
            self.roff = region[2]
        if len(desc) != 64:
            raise ValueError("a descriptor is 64 bytes")
        memcpy(self.desc, <const char*>desc, 64)
        if two:  # (cdivision: C's truncating division, so round up by hand)
            self.npieces = max(1, (self.bounds[1] - self.bounds[0] + seg - 1) // seg)
        else:
            self.npieces = max(1, (count + piece - 1) // piece)

    @property
    def pieces(self):
        return self.npieces

    @property
    def waited(self):
        return self.w.waited

    @property
    def waiting(self):
        """``(counter, value)`` of the last wait (what a timed-out rank was waiting for)."""
        return self.wait_index, self.wait_value

    cdef int _wait(self, int index, uint64_t value, int* culprit) noexcept nogil:
        self.wait_index, self.wait_value = index, value
        return win_wait_all(&self.w, index, value, self.deadline, culprit)

    def start(self, cnp.ndarray buf, cnp.ndarray out, uint64_t t0, int64_t seq, double deadline):
        """Bind ``buf`` (and ``out``, for a gather) and the first tick; the descriptor takes ``seq``."""
        self.held = (buf, out)
        self.buf = <char*>cnp.PyArray_DATA(buf)
        self.out = <char*>cnp.PyArray_DATA(out) if out is not None else NULL
        self.t0 = t0
        self.k = 0
        self.kin = 0
        self.deadline = deadline
        memcpy(self.desc + 20, &seq, 8)  # the Record's seq field (gradcoll.algorithms._handshake)

    def run(self, Py_ssize_t limit):
        """Advance at most ``limit`` pieces: ``(status, culprit, piece, phase)`` (S_MORE while pieces are left).

        ``phase`` is the step it was in: 1 copying in and waiting for the others' pieces, 2 reducing and
        waiting for the others' shares, 3 copying out and waiting for the others to be done.
        """
        cdef int st, culprit = -1
        cdef Py_ssize_t stop = self.k + limit
        if stop > self.npieces:
            stop = self.npieces
        with nogil:
            st = self._run(stop, &culprit)
        if st != S_MORE:
            self.held = None
        return st, culprit, self.k, self.phase

    # -- where things are -------------------------------------------------------------------------
    cdef inline char* _data(self, int r, Py_ssize_t k, int q) noexcept nogil:
        """Rank ``r``'s copy of share ``q`` of piece ``k`` (two-shot) or of piece ``k`` (one-shot)."""
        cdef Py_ssize_t e
        if self.region:
            e = self.bounds[q] + k * self.seg if self.two else k * self.piece
            return self.rbase + r * self.rstride + self.roff + e * self.witem
        if self.own and r == self.w.me and q == r:
            return self.buf + (self.bounds[q] + k * self.seg) * self.item
        e = q * self.seg if self.two else 0
        return (self.w.base + self.w.slots + r * self.w.stride + ((self.t0 + k) % self.depth) * self.ring
                + e * self.witem)

    cdef inline char* _result(self, int r, Py_ssize_t k) noexcept nogil:
        return (self.w.base + self.w.slots + r * self.w.stride + self.res_off
                + ((self.t0 + k) % self.depth) * self.rslot)

    cdef inline void _share(self, Py_ssize_t k, int q, Py_ssize_t* a, Py_ssize_t* b) noexcept nogil:
        """Elements ``[a, b)`` of share ``q`` of piece ``k`` (two-shot) or of piece ``k`` (one-shot)."""
        if self.two:
            a[0] = self.bounds[q] + k * self.seg
            b[0] = a[0] + self.seg
            if b[0] > self.bounds[q + 1]:
                b[0] = self.bounds[q + 1]
            if a[0] > b[0]:
                a[0] = b[0]
        else:
            a[0] = k * self.piece
            b[0] = a[0] + self.piece
            if b[0] > self.count:
                b[0] = self.count

    cdef inline char* _desc(self, int r) noexcept nogil:
        return self.w.base + self.w.headers + r * HEADER_BYTES + H_DESCRIPTORS + (self.t0 % N_DESCRIPTORS) * 64

    # -- the steps --------------------------------------------------------------------------------
    cdef int _wait_done(self, uint64_t t, int* culprit) noexcept nogil:
        """Before reusing the ring buffer of tick ``t``: every rank is done with tick ``t - depth``."""
        if t + 1 <= <uint64_t>self.depth:
            return W_OK
        return self._wait(DONE, t + 1 - self.depth, culprit)

    cdef int _copy_in(self, Py_ssize_t k, int* culprit) noexcept nogil:
        cdef uint64_t t = self.t0 + k
        cdef int st, q, nq
        cdef Py_ssize_t a, b
        st = self._wait_done(t, culprit)
        if st != W_OK:
            return st
        if not self.region and (self.op != OP_BCAST or self.root == self.w.me):
            nq = self.w.n if self.two else 1
            for q in range(nq):
                self._share(k, q, &a, &b)
                if b > a and not (self.own and q == self.w.me):
                    if self.variant >= V_BF16 and self.item == 4:
                        gcd_encode(<float*>(self.buf + a * 4), <uint16_t*>self._data(self.w.me, k, q), b - a,
                                   self.fp16)
                    else:
                        gcd_copy(self._data(self.w.me, k, q), self.buf + a * self.item, (b - a) * self.item)
        if k == 0:
            memcpy(self._desc(self.w.me), self.desc, 64)
        win_publish(&self.w, ARRIVED, self.t0 + (self.npieces if self.region else k + 1))
        return W_OK

    cdef bint _reduce(self, Py_ssize_t k, int q, char* out, float* dec, Py_ssize_t m) noexcept nogil:
        """Reduce share ``q`` of piece ``k`` (or piece ``k``) of every rank into ``out``; False if not finite."""
        cdef void* xs[MAXN]
        cdef int r, mode, n = self.w.n
        cdef const float* mine
        for r in range(n):
            xs[r] = self._data(r, k, q)
        if self.variant >= V_BF16:
            mine = <const float*>xs[self.w.me] if self.own and q == self.w.me else NULL
            return gcd_wire_reduce(<const uint16_t* const*>xs, n, m, <uint16_t*>out, dec, <float>self.divisor,
                                   self.dodiv, self.fp16, self.table, mine, self.w.me) == 0 or not self.check
        if self.variant == V_EXACT:
            if n == 2 and not self.f64 and (self.recip == 0.5 or self.recip == 1.0):
                # Two float32 contributions: the float32 sum, halved for a mean, has the exact reduction's bits
                # wherever it is finite (gcd_exact2_f32_avx2's reasoning), and that is the plain reduce's loop
                # on two inputs: the plain call's cost. Where it is not finite (a sum beyond float32's range
                # whose mean may be in it, or a NaN or Inf) the exact reduction redoes the piece and decides.
                if gc_reduce_ff(<const float* const*>xs, 2, m, <float*>out, <float>self.recip,
                                GC_MUL if self.dodiv else GC_NONE, 0) != 0:
                    return True
                r = gcd_exact32(<const float* const*>xs, n, m, <float*>out, self.divisor, self.recip,
                                self.limit, self.hi, self.lo, self.bmin)
                return r == 0 or not self.check
            if self.f64:
                r = gcd_exact_f64(<const double* const*>xs, n, m, <double*>out, self.divisor, self.recip,
                                  self.limit, self.hi, self.lo, self.bmin)
            else:
                r = gcd_exact32(<const float* const*>xs, n, m, <float*>out, self.divisor, self.recip,
                                self.limit, self.hi, self.lo, self.bmin)
            return r == 0 or not self.check
        if self.op <= OP_SUM:  # rank order 0..n-1, then the division (a multiply where 1/n is exact: the same bits)
            mode = GC_NONE if not self.dodiv else (GC_MUL if self.recip > 0 else GC_DIV)
            if self.f64:
                return gc_reduce_dd(<const double* const*>xs, n, m, <double*>out,
                                    self.recip if mode == GC_MUL else self.divisor, mode, 0) != 0 or not self.check
            return gc_reduce_ff(<const float* const*>xs, n, m, <float*>out,
                                <float>(self.recip if mode == GC_MUL else self.divisor), mode, 0) != 0 or not self.check
        if self.f64:
            return _minmax[double](<double**>xs, n, m, <double*>out, self.op == OP_MAX, self.check)
        return _minmax[float](<float**>xs, n, m, <float*>out, self.op == OP_MAX, self.check)

    cdef void _move(self, Py_ssize_t k, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
        """The step of a gather or a broadcast: copy piece ``k`` (bytes ``[a, b)``) out of the slots."""
        cdef int r
        if b <= a:
            return
        if self.op == OP_BCAST:
            if self.root != self.w.me:
                gcd_copy(self.buf + a, self._data(self.root, k, 0), b - a)
            return
        for r in range(self.w.n):
            gcd_copy(self.out + r * self.count + a, self._data(r, k, 0), b - a)

    cdef int _mismatch(self) noexcept nogil:
        cdef int r
        for r in range(self.w.n):
            if memcmp(self._desc(r), self.desc, 64) != 0:
                return r
        return -1

    cdef int _run(self, Py_ssize_t stop, int* culprit) noexcept nogil:
        cdef Py_ssize_t k, a, b
        cdef uint64_t t
        cdef int st, q, me = self.w.me, n = self.w.n
        cdef char* rep
        cdef char* res
        cdef uint64_t mark
        if self.w.n > MAXN:
            return S_MISMATCH
        while self.k < stop:
            k = self.k
            t = self.t0 + k
            self.phase = 1
            if self.region:
                if k == 0 and self.kin == 0:
                    st = self._copy_in(0, culprit)  # the data is in place: only the descriptor and the counter
                    if st != W_OK:
                        return st
                    self.kin = self.npieces
                st = self._wait_done(t, culprit)  # the result ring buffer of tick t is free
                if st != W_OK:
                    return st
            else:
                while self.kin <= k + 1 and self.kin < self.npieces:
                    st = self._copy_in(self.kin, culprit)
                    if st != W_OK:
                        return st
                    self.kin += 1
            st = self._wait(ARRIVED, t + 1, culprit)
            if st != W_OK:
                return st
            if k == 0:
                culprit[0] = self._mismatch()
                if culprit[0] >= 0:
                    return S_MISMATCH
            self.phase = 2
            if self.op >= OP_GATHER:
                self._share(k, 0, &a, &b)
                self._move(k, a, b)
                win_publish(&self.w, DONE, t + 1)
                self.k += 1
                continue
            if not self.two:
                self._share(k, 0, &a, &b)
                if self.variant >= V_BF16 and self.item == 4:
                    if not self._reduce(k, 0, NULL, <float*>(self.buf + a * 4), b - a):
                        return S_NONFINITE
                elif not self._reduce(k, 0, self.buf + a * self.item, NULL, b - a):
                    return S_NONFINITE
                win_publish(&self.w, DONE, t + 1)
                self.k += 1
                continue
            self._share(k, me, &a, &b)
            rep = self.w.base + self.w.headers + me * HEADER_BYTES + H_REPORT
            if b > a and not self._reduce(k, me, self._result(me, k), NULL, b - a):
                mark = t + 1
                memcpy(rep, &mark, 8)
            win_publish(&self.w, REDUCED, t + 1)
            self.phase = 3
            st = self._wait(REDUCED, t + 1, culprit)
            if st != W_OK:
                return st
            for q in range(n):
                memcpy(&mark, self.w.base + self.w.headers + q * HEADER_BYTES + H_REPORT, 8)
                if mark == t + 1:
                    culprit[0] = q
                    self._share(k, me, &a, &b)
                    if self.own and b > a:  # the scan of the error path reads every rank's piece in its slot
                        rep = (self.w.base + self.w.slots + me * self.w.stride
                               + ((self.t0 + k) % self.depth) * self.ring + me * self.seg * self.witem)
                        if self.variant >= V_BF16:
                            gcd_encode(<float*>(self.buf + a * 4), <uint16_t*>rep, b - a, self.fp16)
                        else:
                            gcd_copy(rep, self.buf + a * self.item, (b - a) * self.item)
                    win_publish(&self.w, FILLED, t + 1)
                    return S_NONFINITE
            for q in range(n):
                if self.scatter and q != me:
                    continue
                self._share(k, q, &a, &b)
                if b > a:
                    res = self._result(q, k)
                    if self.variant >= V_BF16 and self.item == 4:
                        gcd_decode(<uint16_t*>res, <float*>(self.buf + a * 4), b - a, self.fp16, self.table)
                    else:
                        gcd_copy(self.buf + a * self.item, res, (b - a) * self.item)
            win_publish(&self.w, DONE, t + 1)
            self.k += 1
        if self.k < self.npieces:
            return S_MORE
        self.phase = 3
        if self.region:  # peers read this rank's region until they are done: the caller may write it after
            return self._wait(DONE, self.t0 + self.npieces, culprit)
        return S_DONE


cdef class Runner:
    """The ticks and engines of one group window, and the engine's path of a plain allreduce in one C call.

    ``tick`` is the window's next tick (``_window_run`` advances it for every
    collective, the same on every rank); ``plans`` maps a call's key to its
    ``(shape, plan, descriptor)``. ``allreduce`` takes a plain call (an
    aligned, C-contiguous, writeable float32/float64 array, wholly inside
    an allocated region or outside all of them, an op code, the finite
    check) whose plan is already in ``fast``: it binds, runs every batch and accounts the waits without
    returning to Python. It returns None when the collective completed,
    NotImplemented when it does not take the call, else the failure
    ``(status, culprit, piece, phase, t0, entry)``.
    """

    cdef public uint64_t tick
    cdef public dict plans
    cdef public dict fast
    cdef public Py_ssize_t batch_bytes
    cdef object transport
    cdef list regions

    def __init__(self, transport, Py_ssize_t batch_bytes):
        self.tick = 0
        self.plans = {}
        self.fast = {}
        self.regions = []
        self.transport = transport
        self.batch_bytes = batch_bytes

    def add_region(self, Py_ssize_t start, Py_ssize_t end):
        """Buffers in ``[start, end)`` (this rank's slot of allocated window ``i``, the ``i``-th added) take
        the engine's path under ``(key, i, offset)``: that region's engine, which reads them in place."""
        self.regions.append((start, end))

    @staticmethod
    def key(Py_ssize_t size, int typenum, int op, bint check, int variant=0):
        """The key of ``fast`` for a call of ``variant`` (plain, exact, bf16 or fp16 wire)."""
        return ((((size << 3) | op) << 1 | check) << 1 | (typenum == cnp.NPY_DOUBLE)) << 2 | variant

    def allreduce(self, object buf, int op, bint check, int64_t seq, double timeout, int variant=0):
        cdef cnp.ndarray a
        cdef int typenum, st, culprit = -1
        cdef Py_ssize_t size, addr, stop, per, batch
        cdef uint64_t t0
        cdef double before
        cdef Plan plan
        cdef object entry, key
        if not cnp.PyArray_CheckExact(buf):
            return NotImplemented
        a = <cnp.ndarray>buf
        typenum = cnp.PyArray_TYPE(a)
        if (typenum != cnp.NPY_FLOAT and typenum != cnp.NPY_DOUBLE) or not cnp.PyArray_ISCARRAY(a):
            return NotImplemented
        size = cnp.PyArray_SIZE(a)
        key = ((((size << 3) | op) << 1 | check) << 1 | (typenum == cnp.NPY_DOUBLE)) << 2 | variant
        if self.regions:  # a buffer of an allocated region: that region's engine, for the buffer's offset
            addr = <Py_ssize_t>cnp.PyArray_DATA(a)
            stop = addr + size * cnp.PyArray_ITEMSIZE(a)
            for i, lo_hi in enumerate(self.regions):
                if addr < <Py_ssize_t>lo_hi[1] and stop > <Py_ssize_t>lo_hi[0]:
                    if size == 0 or addr < <Py_ssize_t>lo_hi[0] or stop > <Py_ssize_t>lo_hi[1]:
                        return NotImplemented
                    key = (key, i, addr - <Py_ssize_t>lo_hi[0])
                    break
        entry = self.fast.get(key)
        if entry is None:
            return NotImplemented
        plan = <Plan>entry[1]
        t0 = self.tick
        self.tick += plan.npieces
        plan.held = (a, None)
        plan.buf = <char*>cnp.PyArray_DATA(a)
        plan.out = NULL
        plan.t0, plan.k, plan.kin = t0, 0, 0
        plan.deadline = win_now() + timeout
        memcpy(plan.desc + 20, &seq, 8)
        per = (plan.seg * plan.w.n if plan.two else plan.piece) * plan.witem
        batch = self.batch_bytes // per if per > 0 else 1
        if batch < 1:
            batch = 1
        before = plan.w.waited
        while True:
            stop = plan.k + batch
            if stop > plan.npieces:
                stop = plan.npieces
            with nogil:
                st = plan._run(stop, &culprit)
            if st != S_MORE:
                break
            self.transport.note_wait(plan.w.waited - before)
            before = plan.w.waited
        self.transport.note_wait(plan.w.waited - before)
        plan.held = None
        if st == S_DONE:
            return None
        return st, culprit, plan.k, plan.phase, t0, entry
