/* The fused loops of the compiled extension (_cython_kernels.pyx declares and calls them).
 *
 * One pass over memory per call: every input is read once, every output
 * written once, and the finite check is folded into the same pass. Why this
 * shape (docs/kernels.md, "Why the kernels were slow"):
 *
 *  - Inputs are summed in registers, all n streams at once: element i of
 *    the output is ((x0[i] + x1[i]) + x2[i]) + ... in that order, stored
 *    once. The former kernels added one input at a time into a block of the
 *    output, which stored every output element n times and cut each input
 *    stream into 8 KiB pieces that the hardware prefetcher had to find
 *    again.
 *  - The loops are written with GCC/Clang vector types, so the compiler
 *    does not have to prove that n input pointers do not alias the output
 *    (it gives up on that beyond a few pointers), and target_clones builds
 *    an AVX2 version next to the baseline SSE2 one, picked at load time.
 *  - The finite check ORs the exponent bits of each result vector into a
 *    flag: ((bits & EXP) + ULP) has its top bit set exactly when the
 *    exponent is all ones (Inf or NaN). No branch per element; the flag is
 *    tested once, at the end. A NaN or Inf in any input reaches the sum, and
 *    so does an overflow, so checking the result checks everything.
 *  - Outputs too large to stay in cache may be written with non-temporal
 *    stores (the caller decides, from the size), which skip the read for
 *    ownership of every output line.
 *
 * Bits: only IEEE add, multiply and divide, in the documented order; the
 * build turns off floating-point contraction (-ffp-contract=off), and a
 * "multiply" finish is used only when the reciprocal is exact (a power of
 * two), where it gives the same bits as the division.
 */
#ifndef GRADCOLL_FUSED_H
#define GRADCOLL_FUSED_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define GC_HAVE_NT 1
#else
#define GC_HAVE_NT 0
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define GC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define GC_CLONES
#endif

typedef ptrdiff_t gc_ssize;

/* Finishing step of a reduce or accumulate: none, multiply by an exact reciprocal, or divide. */
enum { GC_NONE = 0, GC_MUL = 1, GC_DIV = 2 };

#define GC_EXP32 0x7f800000u
#define GC_ULP32 0x00800000u
#define GC_TOP32 0x80000000u
#define GC_EXP64 0x7ff0000000000000ull
#define GC_ULP64 0x0010000000000000ull
#define GC_TOP64 0x8000000000000000ull

static inline uint32_t gc_flag32(float v) { uint32_t b; memcpy(&b, &v, 4); return (b & GC_EXP32) + GC_ULP32; }
static inline uint64_t gc_flag64(double v) { uint64_t b; memcpy(&b, &v, 8); return (b & GC_EXP64) + GC_ULP64; }

#if defined(__GNUC__)
#define GC_VECTORS 1
typedef float gc_v8f __attribute__((vector_size(32)));
typedef uint32_t gc_v8u __attribute__((vector_size(32)));
typedef int32_t gc_v8i __attribute__((vector_size(32)));
typedef uint16_t gc_v8h __attribute__((vector_size(16)));
typedef double gc_v4d __attribute__((vector_size(32)));
typedef uint64_t gc_v4u __attribute__((vector_size(32)));
typedef float gc_v4f __attribute__((vector_size(16)));

static inline gc_v8f gc_ld8f(const float *p) { gc_v8f v; memcpy(&v, p, 32); return v; }
static inline gc_v4d gc_ld4d(const double *p) { gc_v4d v; memcpy(&v, p, 32); return v; }
static inline gc_v4d gc_ld4fd(const float *p) { gc_v4f v; memcpy(&v, p, 16); return __builtin_convertvector(v, gc_v4d); }
static inline gc_v8u gc_ld8u(const uint32_t *p) { gc_v8u v; memcpy(&v, p, 32); return v; }
static inline gc_v8u gc_ld8h(const uint16_t *p) { gc_v8h v; memcpy(&v, p, 16); return __builtin_convertvector(v, gc_v8u); }

static inline void gc_st8f(float *p, gc_v8f v, int nt) {
#if GC_HAVE_NT
    if (nt) {
        union { gc_v8f v; __m128 h[2]; } u;
        u.v = v;
        _mm_stream_ps(p, u.h[0]);
        _mm_stream_ps(p + 4, u.h[1]);
        return;
    }
#endif
    (void)nt;
    memcpy(p, &v, 32);
}

static inline void gc_st4d(double *p, gc_v4d v, int nt) {
#if GC_HAVE_NT
    if (nt) {
        union { gc_v4d v; __m128d h[2]; } u;
        u.v = v;
        _mm_stream_pd(p, u.h[0]);
        _mm_stream_pd(p + 2, u.h[1]);
        return;
    }
#endif
    (void)nt;
    memcpy(p, &v, 32);
}

static inline void gc_fence(int nt) {
#if GC_HAVE_NT
    if (nt)
        _mm_sfence();  /* non-temporal stores are weakly ordered: make them visible before returning */
#endif
    (void)nt;
}
#endif /* __GNUC__ */

/* Non-temporal stores need 16-byte aligned destinations; otherwise the plain store path runs. */
static inline int gc_nt_ok(const void *p, int nt) { return nt && GC_HAVE_NT && ((uintptr_t)p & 15u) == 0; }

/* ---- finite check of a buffer: 1 when no element is NaN/Inf (stops at the first bad 64 KiB) ------------- */

/* Each element's exponent bits, OR-ed into a flag (the compiler vectorises it): the exact test. */
#define GC_DEFINE_FINITE_EXACT(NAME, T, UT, FLAG1, TOP)                                                \
    static inline int NAME(const T *p, gc_ssize m) {                                                   \
        gc_ssize i;                                                                                    \
        UT flag = 0;                                                                                   \
        for (i = 0; i < m; i++)                                                                        \
            flag |= FLAG1(p[i]);                                                                       \
        return (flag & (TOP)) == 0;                                                                    \
    }
GC_DEFINE_FINITE_EXACT(gc_finite_f_exact, float, uint32_t, gc_flag32, GC_TOP32)
GC_DEFINE_FINITE_EXACT(gc_finite_d_exact, double, uint64_t, gc_flag64, GC_TOP64)

#if defined(GC_VECTORS)
/* A 64 KiB block at a time: four vectors added (a NaN or an Inf reaches the sum, and so does an overflow of
 * finite values), then the bits of t - t OR-ed into a flag: +0 for a finite t, NaN otherwise. Only a block
 * whose flag is set gets the exact test, which decides. Much cheaper than the exact test alone on data in
 * L2 (docs/kernels.md, "Aligned stores and a cheaper check"). */
#define GC_DEFINE_FINITE(NAME, EXACT, T, V, VU, W, LOAD, BLK)                                           \
    GC_CLONES static int NAME(const T *p, gc_ssize m) {                                                \
        gc_ssize i = 0, j, stop;                                                                       \
        int k;                                                                                         \
        while (i < m) {                                                                                \
            VU fv = {0};                                                                               \
            stop = (m - i > (BLK)) ? i + (BLK) : m;                                                    \
            for (j = i; j + 4 * (W) <= stop; j += 4 * (W)) {                                           \
                V t = (LOAD(p + j) + LOAD(p + j + (W))) + (LOAD(p + j + 2 * (W)) + LOAD(p + j + 3 * (W))); \
                fv |= (VU)(t - t);                                                                     \
            }                                                                                          \
            for (k = 1; k < (W); k++)                                                                  \
                fv[0] |= fv[k];                                                                        \
            if ((fv[0] != 0 && !EXACT(p + i, j - i)) || !EXACT(p + j, stop - j))                       \
                return 0;                                                                              \
            i = stop;                                                                                  \
        }                                                                                              \
        return 1;                                                                                      \
    }
GC_DEFINE_FINITE(gc_finite_f, gc_finite_f_exact, float, gc_v8f, gc_v8u, 8, gc_ld8f, 16384)
GC_DEFINE_FINITE(gc_finite_d, gc_finite_d_exact, double, gc_v4d, gc_v4u, 4, gc_ld4d, 8192)
#else
#define GC_DEFINE_FINITE(NAME, EXACT, T, BLK)                                                           \
    static int NAME(const T *p, gc_ssize m) {                                                          \
        gc_ssize i, stop;                                                                              \
        for (i = 0; i < m; i = stop) {                                                                 \
            stop = (m - i > (BLK)) ? i + (BLK) : m;                                                    \
            if (!EXACT(p + i, stop - i))                                                               \
                return 0;                                                                              \
        }                                                                                              \
        return 1;                                                                                      \
    }
GC_DEFINE_FINITE(gc_finite_f, gc_finite_f_exact, float, 16384)
GC_DEFINE_FINITE(gc_finite_d, gc_finite_d_exact, double, 8192)
#endif

/* Elements before the first 64-byte boundary of p (at most m): the loops run them one by one, so that the
 * vector loop's stores never split a cache line. With the output 16 or 48 bytes past a line, as the C
 * library's heap often leaves a NumPy array, split stores make the accumulate markedly slower
 * (docs/kernels.md, "Aligned stores and a cheaper check"). */
static inline gc_ssize gc_head(const void *p, size_t size, gc_ssize m) {
    gc_ssize h = (gc_ssize)(((64u - ((uintptr_t)p & 63u)) & 63u) / size);
    return h < m ? h : m;
}

/* ---- reduce: out = finish(x0 + x1 + ... + x{n-1}); returns 1 when every result is finite ---------------- */

/* The vector loop: U=4 vectors of W lanes per step, the n inputs added in order, then the finish. */
#define GC_REDUCE_BODY(TA, VA, VU, W, LOAD, STORE, FLAGV)                                               \
    for (; i + 4 * (W) <= m; i += 4 * (W)) {                                                           \
        const TS *p = xs[0] + i;                                                                       \
        VA s0 = LOAD(p), s1 = LOAD(p + (W)), s2 = LOAD(p + 2 * (W)), s3 = LOAD(p + 3 * (W));            \
        for (j = 1; j < n; j++) {                                                                      \
            p = xs[j] + i;                                                                             \
            s0 += LOAD(p); s1 += LOAD(p + (W)); s2 += LOAD(p + 2 * (W)); s3 += LOAD(p + 3 * (W));      \
        }                                                                                              \
        if (mode == GC_MUL) { s0 *= f; s1 *= f; s2 *= f; s3 *= f; }                                    \
        else if (mode == GC_DIV) { s0 /= f; s1 /= f; s2 /= f; s3 /= f; }                               \
        STORE(out + i, s0, nt); STORE(out + i + (W), s1, nt);                                          \
        STORE(out + i + 2 * (W), s2, nt); STORE(out + i + 3 * (W), s3, nt);                            \
        s0 = (s0 + s1) + (s2 + s3);                                                                    \
        FLAGV |= (VU)(s0 - s0);                                                                        \
    }

/* The scalar loop (the head up to an aligned output, the tail, and compilers without vector types). */
#define GC_REDUCE_TAIL(TA, FLAG1, END)                                                                 \
    for (; i < (END); i++) {                                                                           \
        TA s = (TA)xs[0][i];                                                                           \
        for (j = 1; j < n; j++)                                                                        \
            s += (TA)xs[j][i];                                                                         \
        if (mode == GC_MUL) s *= f;                                                                    \
        else if (mode == GC_DIV) s /= f;                                                               \
        out[i] = s;                                                                                    \
        flag |= FLAG1(s);                                                                              \
    }

#if defined(GC_VECTORS)
/* The loop is written once (NAME##_n, always inlined) and entered with n a constant for 2-8 inputs: the
 * compiler then unrolls the loop over the inputs and keeps their pointers in registers. With n known only
 * at run time it reloaded each pointer in every step, and on large inputs laid out as the C library's heap
 * places them (arrays a few KiB apart in their pages) a reduce of several inputs took several times as
 * long (docs/kernels.md). */
#define GC_DEFINE_REDUCE(NAME, TS_, TA_, VA, VU, W, LOAD, STORE, UT, FLAG1, FINITE, TOP)               \
    static inline __attribute__((always_inline)) int NAME##_n(const TS_ *const *xs, gc_ssize n,        \
                                                               gc_ssize m, TA_ *restrict out, TA_ f,   \
                                                               int mode, int nt) {                     \
        typedef TS_ TS;                                                                                \
        gc_ssize i = 0, j;                                                                             \
        VU fv = {0};                                                                                   \
        UT flag = 0;                                                                                   \
        int k;                                                                                         \
        gc_ssize head = gc_head(out, sizeof(TA_), m), start;                                            \
        UT vflag = 0;                                                                                  \
        GC_REDUCE_TAIL(TA_, FLAG1, head)                                                               \
        start = i;                                                                                     \
        nt = gc_nt_ok(out + i, nt);                                                                    \
        GC_REDUCE_BODY(TA_, VA, VU, W, LOAD, STORE, fv)                                                \
        gc_fence(nt);                                                                                  \
        for (k = 0; k < (W); k++)                                                                      \
            vflag |= fv[k];                                                                            \
        if (vflag != 0 && !FINITE(out + start, i - start)) /* an Inf/NaN, or the sum of four overflowed */ \
            flag |= (TOP);                                                                             \
        GC_REDUCE_TAIL(TA_, FLAG1, m)                                                                  \
        return (flag & (TOP)) == 0;                                                                    \
    }                                                                                                  \
    GC_CLONES static int NAME(const TS_ *const *xs, gc_ssize n, gc_ssize m, TA_ *restrict out, TA_ f,  \
                              int mode, int nt) {                                                      \
        switch (n) {                                                                                   \
        case 2: return NAME##_n(xs, 2, m, out, f, mode, nt);                                           \
        case 3: return NAME##_n(xs, 3, m, out, f, mode, nt);                                           \
        case 4: return NAME##_n(xs, 4, m, out, f, mode, nt);                                           \
        case 5: return NAME##_n(xs, 5, m, out, f, mode, nt);                                           \
        case 6: return NAME##_n(xs, 6, m, out, f, mode, nt);                                           \
        case 7: return NAME##_n(xs, 7, m, out, f, mode, nt);                                           \
        case 8: return NAME##_n(xs, 8, m, out, f, mode, nt);                                           \
        default: return NAME##_n(xs, n, m, out, f, mode, nt);                                          \
        }                                                                                              \
    }
#else
#define GC_DEFINE_REDUCE(NAME, TS_, TA_, VA, VU, W, LOAD, STORE, UT, FLAG1, FINITE, TOP)               \
    static int NAME(const TS_ *const *xs, gc_ssize n, gc_ssize m, TA_ *out, TA_ f, int mode, int nt) {  \
        gc_ssize i = 0, j;                                                                             \
        UT flag = 0;                                                                                   \
        (void)nt;                                                                                      \
        GC_REDUCE_TAIL(TA_, FLAG1, m)                                                                  \
        return (flag & (TOP)) == 0;                                                                    \
    }
#endif

GC_DEFINE_REDUCE(gc_reduce_ff, float, float, gc_v8f, gc_v8u, 8, gc_ld8f, gc_st8f, uint32_t, gc_flag32,
                 gc_finite_f, GC_TOP32)
GC_DEFINE_REDUCE(gc_reduce_dd, double, double, gc_v4d, gc_v4u, 4, gc_ld4d, gc_st4d, uint64_t, gc_flag64,
                 gc_finite_d, GC_TOP64)
GC_DEFINE_REDUCE(gc_reduce_fd, float, double, gc_v4d, gc_v4u, 4, gc_ld4fd, gc_st4d, uint64_t, gc_flag64,
                 gc_finite_d, GC_TOP64)

/* ---- accumulate: acc = scale(finish(acc + x)); returns 1 when every result is finite --------------------- */

#define GC_ACC_STEP(s)                                                                                 \
    if (mode == GC_MUL) s *= d; else if (mode == GC_DIV) s /= d;                                       \
    if (doscale) s *= sc;

/* The scalar loop, up to END (the head before an aligned accumulator, the tail); it stops before an element
 * of acc for which STOP (on s, that element) holds. */
#define GC_ACC_TAIL_IF(T, FLAG1, END, STOP)                                                            \
    for (; i < (END); i++) {                                                                           \
        T s = acc[i];                                                                                  \
        if (STOP)                                                                                      \
            break;                                                                                     \
        s += x[i];                                                                                     \
        GC_ACC_STEP(s)                                                                                 \
        acc[i] = s;                                                                                    \
        flag |= FLAG1(s);                                                                              \
    }
#define GC_ACC_TAIL(T, FLAG1, END) GC_ACC_TAIL_IF(T, FLAG1, END, 0)

#if defined(GC_VECTORS)
/* Written once (NAME##_k, always inlined) and entered with the mode and the scale flag constants: with them
 * known only at run time the loop tested them in every step, and the accumulate with a divisor fell behind
 * the plain loop, which it beats with them constant (docs/kernels.md, "The accumulate's mode"). */
#define GC_DEFINE_ACC(NAME, T, V, VU, W, LOAD, STORE, UT, FLAG1, FINITE, TOP)                          \
    static inline __attribute__((always_inline)) int NAME##_k(T *acc, const T *x, gc_ssize m, T d,     \
                                                               int mode, T sc, int doscale) {          \
        gc_ssize i = 0, head = gc_head(acc, sizeof(T), m), start;                                      \
        VU fv = {0};                                                                                   \
        UT flag = 0, vflag = 0;                                                                        \
        int k;                                                                                         \
        GC_ACC_TAIL(T, FLAG1, head)                                                                    \
        start = i;                                                                                     \
        for (; i + 2 * (W) <= m; i += 2 * (W)) {                                                       \
            V s0 = LOAD(acc + i) + LOAD(x + i), s1 = LOAD(acc + i + (W)) + LOAD(x + i + (W)), t;       \
            GC_ACC_STEP(s0) GC_ACC_STEP(s1)                                                            \
            STORE(acc + i, s0, 0); STORE(acc + i + (W), s1, 0);                                        \
            t = s0 + s1;                                                                               \
            fv |= (VU)(t - t);                                                                         \
        }                                                                                              \
        for (k = 0; k < (W); k++)                                                                      \
            vflag |= fv[k];                                                                            \
        if (vflag != 0 && !FINITE(acc + start, i - start)) /* an Inf/NaN, or s0 + s1 overflowed */    \
            flag |= (TOP);                                                                             \
        GC_ACC_TAIL(T, FLAG1, m)                                                                       \
        return (flag & (TOP)) == 0;                                                                    \
    }                                                                                                  \
    GC_CLONES static int NAME(T *acc, const T *x, gc_ssize m, T d, int mode, T sc, int doscale) {      \
        if (doscale)                                                                                   \
            return NAME##_k(acc, x, m, d, mode, sc, 1);                                                \
        if (mode == GC_MUL)                                                                            \
            return NAME##_k(acc, x, m, d, GC_MUL, sc, 0);                                              \
        if (mode == GC_DIV)                                                                            \
            return NAME##_k(acc, x, m, d, GC_DIV, sc, 0);                                              \
        return NAME##_k(acc, x, m, d, GC_NONE, sc, 0);                                                 \
    }
#else
#define GC_DEFINE_ACC(NAME, T, V, VU, W, LOAD, STORE, UT, FLAG1, FINITE, TOP)                          \
    static int NAME(T *acc, const T *x, gc_ssize m, T d, int mode, T sc, int doscale) {                \
        gc_ssize i;                                                                                    \
        UT flag = 0;                                                                                   \
        for (i = 0; i < m; i++) {                                                                      \
            T s = acc[i] + x[i];                                                                       \
            GC_ACC_STEP(s)                                                                             \
            acc[i] = s;                                                                                \
            flag |= FLAG1(s);                                                                          \
        }                                                                                              \
        return (flag & (TOP)) == 0;                                                                    \
    }
#endif

GC_DEFINE_ACC(gc_acc_f_base, float, gc_v8f, gc_v8u, 8, gc_ld8f, gc_st8f, uint32_t, gc_flag32, gc_finite_f, GC_TOP32)
GC_DEFINE_ACC(gc_acc_d, double, gc_v4d, gc_v4u, 4, gc_ld4d, gc_st4d, uint64_t, gc_flag64, gc_finite_d, GC_TOP64)

/* The accumulate that checks acc's own values (this rank's input) in the same pass, for the tcp step, where a
 * separate check read them once more just before. acc = finish(acc + x), element for element as the accumulate
 * above (the same bits), for the elements before the returned index: m, unless a block of 16 vectors of acc (or
 * one element of the head or tail) may hold a NaN or an Inf (a sum of its values is not finite: an overflow of
 * finite values sets it too); that block and everything after it is left as it was, for the caller's exact check
 * and accumulate. A block is checked, then added from the first-level cache: testing every few vectors before
 * adding them cost more, and the block's way makes a large allreduce faster (docs/performance.md, "named calls
 * on the fast path"). *fin: whether every sum written is finite. */
/* Its scalar loop, up to END: stops at an element of acc that is not finite, before writing it. */
#define GC_ACC_IN_TAIL(T, FLAG1, TOP, END) GC_ACC_TAIL_IF(T, FLAG1, END, FLAG1(s) & (TOP))

#if defined(GC_VECTORS)
#define GC_DEFINE_ACC_IN(NAME, T, V, VU, W, LOAD, STORE, UT, FLAG1, FINITE, TOP)                       \
    static inline __attribute__((always_inline)) gc_ssize NAME##_k(T *acc, const T *x, gc_ssize m, T d, \
                                                                    int mode, int *fin) {              \
        gc_ssize i = 0, head = gc_head(acc, sizeof(T), m), start;                                      \
        VU fv = {0};                                                                                   \
        UT flag = 0, vflag = 0, any;                                                                   \
        const int doscale = 0;                                                                         \
        const T sc = 1;                                                                                \
        int k;                                                                                         \
        GC_ACC_IN_TAIL(T, FLAG1, TOP, head)                                                            \
        if (i < head)                                                                                  \
            goto done;                                                                                 \
        start = i;                                                                                     \
        for (; i + 16 * (W) <= m; i += 16 * (W)) { /* a block of 16 vectors: checked, then added (from L1) */ \
            VU z = {0};                                                                                \
            gc_ssize j;                                                                                \
            for (j = i; j < i + 16 * (W); j += 4 * (W)) {                                              \
                V t = (LOAD(acc + j) + LOAD(acc + j + (W))) + (LOAD(acc + j + 2 * (W)) + LOAD(acc + j + 3 * (W))); \
                z |= (VU)(t - t);                                                                      \
            }                                                                                          \
            any = 0;                                                                                   \
            for (k = 0; k < (W); k++)                                                                  \
                any |= z[k];                                                                           \
            if (any)                                                                                   \
                break;                                                                                 \
            for (j = i; j < i + 16 * (W); j += 4 * (W)) {                                              \
                V a0 = LOAD(acc + j) + LOAD(x + j), a1 = LOAD(acc + j + (W)) + LOAD(x + j + (W)),      \
                  a2 = LOAD(acc + j + 2 * (W)) + LOAD(x + j + 2 * (W)),                                \
                  a3 = LOAD(acc + j + 3 * (W)) + LOAD(x + j + 3 * (W)), t;                             \
                GC_ACC_STEP(a0) GC_ACC_STEP(a1) GC_ACC_STEP(a2) GC_ACC_STEP(a3)                        \
                STORE(acc + j, a0, 0); STORE(acc + j + (W), a1, 0);                                    \
                STORE(acc + j + 2 * (W), a2, 0); STORE(acc + j + 3 * (W), a3, 0);                      \
                t = (a0 + a1) + (a2 + a3);                                                             \
                fv |= (VU)(t - t);                                                                     \
            }                                                                                          \
        }                                                                                              \
        for (k = 0; k < (W); k++)                                                                      \
            vflag |= fv[k];                                                                            \
        if (vflag != 0 && !FINITE(acc + start, i - start)) /* an Inf/NaN, or the sums' sum overflowed */ \
            flag |= (TOP);                                                                             \
        if (i + 16 * (W) <= m)                                                                         \
            goto done; /* a block that may hold a bad input: the caller's */                           \
        GC_ACC_IN_TAIL(T, FLAG1, TOP, m)                                                               \
    done:                                                                                              \
        *fin = (flag & (TOP)) == 0;                                                                    \
        return i;                                                                                      \
    }                                                                                                  \
    GC_CLONES __attribute__((unused)) static gc_ssize NAME(T *acc, const T *x, gc_ssize m, T d, int mode, \
                                                          int *fin) {                           \
        if (mode == GC_MUL)                                                                            \
            return NAME##_k(acc, x, m, d, GC_MUL, fin);                                                \
        if (mode == GC_DIV)                                                                            \
            return NAME##_k(acc, x, m, d, GC_DIV, fin);                                                \
        return NAME##_k(acc, x, m, d, GC_NONE, fin);                                                   \
    }
#else
#define GC_DEFINE_ACC_IN(NAME, T, V, VU, W, LOAD, STORE, UT, FLAG1, FINITE, TOP)                       \
    __attribute__((unused)) static gc_ssize NAME(T *acc, const T *x, gc_ssize m, T d, int mode, int *fin) { \
        gc_ssize i;                                                                                    \
        UT flag = 0;                                                                                   \
        const int doscale = 0;                                                                         \
        const T sc = 1;                                                                                \
        i = 0;                                                                                         \
        GC_ACC_IN_TAIL(T, FLAG1, TOP, m)                                                               \
        *fin = (flag & (TOP)) == 0;                                                                    \
        return i;                                                                                      \
    }
#endif

GC_DEFINE_ACC_IN(gc_acc_in_f, float, gc_v8f, gc_v8u, 8, gc_ld8f, gc_st8f, uint32_t, gc_flag32, gc_finite_f, GC_TOP32)
GC_DEFINE_ACC_IN(gc_acc_in_d, double, gc_v4d, gc_v4u, 4, gc_ld4d, gc_st4d, uint64_t, gc_flag64, gc_finite_d, GC_TOP64)

/* ---- low precision: float32 <-> bf16/fp16 bit patterns (the rules: lowp_reference.py) ------------------- */

/* bf16: round to nearest even on the bits; a NaN keeps sign and top payload and is quieted. */
static inline uint32_t gc_bf16(uint32_t u) {
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t q = (u >> 16) | 0x0040u;
    return ((u & 0x7fffffffu) > 0x7f800000u) ? q : r;
}

/* fp16, branch-free: the three ranges computed side by side and one selected (so the loop vectorises).
 * Normal range: rebias the exponent 127 -> 15 and round half to even on the 13 dropped bits (a carry into
 * the exponent gives Inf at 65520). Below 2**-14 (fp16 subnormals and zero): |x| + 0.5f, whose last 10
 * bits are |x| rounded to a multiple of 2**-24 by the hardware's round-to-nearest-even addition. At and
 * above 65536: Inf, or the quieted NaN with the top payload bits. */
static inline uint32_t gc_fp16(uint32_t u) {
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu, sb, nrm, big, r;
    uint32_t is_big = 0u - (uint32_t)(a >= 0x47800000u), is_nan = 0u - (uint32_t)(a > 0x7f800000u);
    uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);  /* masks, not branches: the loop stays straight */
    float fa, fs;
    nrm = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    memcpy(&fa, &a, 4);
    fs = fa + 0.5f;
    memcpy(&sb, &fs, 4);
    sb -= 0x3f000000u;
    big = 0x7c00u | (is_nan & (0x0200u | ((a & 0x007fffffu) >> 13)));
    r = (is_sub & sb) | (~is_sub & nrm);
    return sign | (is_big & big) | (~is_big & r);
}

/* F16C (every x86-64 CPU with AVX2 has it): vcvtps2ph with round-to-nearest-even gives the oracle's bits for
 * every one of the 2**32 float32 patterns (checked once, exhaustively), NaNs included; vcvtph2ps quiets a
 * signalling NaN, which an addition does anyway, so it widens for accumulate but not for a plain decode. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define GC_F16C 1
#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>

/* The widest level of vector loops the CPU has (2: AVX-512 F and BW, 1: AVX2 with F16C, 0: neither),
 * capped by gc_simd_cap, which the tests lower to run every level this CPU has against the reference. */
static int gc_simd_state = -1;
static int gc_simd_cap = 2;

static int gc_simd(void) {
    unsigned a, b, c, d;
    if (gc_simd_state < 0) {  /* a benign race: every thread computes the same answer */
        int s = 0;
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0) {
            s = 1;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
                s = 2;
        }
        gc_simd_state = s;
    }
    return gc_simd_state < gc_simd_cap ? gc_simd_state : gc_simd_cap;
}

/* The level the loops run at, at most ``cap`` (a negative cap only reads it). */
static int gc_set_simd_cap(int cap) {
    if (cap >= 0)
        gc_simd_cap = cap;
    return gc_simd();
}

/* Whether the 512-bit loops that do floating-point work (adds, multiplies, fp16 conversions) run. Not on
 * Intel CPUs, unless GRADCOLL_FP512=1: there a core that has not run such instructions for a few
 * microseconds runs the next ones slowly for a while (its 512-bit units power up, its frequency licence
 * changes), which costs a small or mid-sized accumulate, fp16 encode or bf16 accumulate interleaved with
 * other work more than the wider loop saves, and the loops were no faster than the AVX2 ones when warm
 * (docs/kernels.md, "512-bit floating point on Intel CPUs"); glibc's string functions and LLVM's vectoriser
 * keep to 256 bits there for the same reason. The integer-only 512-bit loop (the bf16 encode) paid nothing
 * and still runs. GRADCOLL_FP512=0 turns them off elsewhere too. */
static int gc_fp512_state = -1;

static int gc_fp512(void) {
    if (gc_fp512_state < 0) {  /* a benign race: every thread computes the same answer */
        unsigned a = 0, b = 0, c = 0, d = 0;
        const char *env = getenv("GRADCOLL_FP512");
        int intel = __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;
        gc_fp512_state = env != NULL && (env[0] == '0' || env[0] == '1') ? env[0] == '1' : !intel;
    }
    return gc_fp512_state;
}

/* The level of the floating-point loops: gc_simd(), without the 512-bit ones where gc_fp512() says no. */
static int gc_simd_fp(void) {
    int s = gc_simd();
    return s >= 2 && !gc_fp512() ? 1 : s;
}

/* Set whether the 512-bit floating-point loops run (0 or 1; the tests run them on every CPU that has them);
 * a negative value only reads it. */
static int gc_set_fp512(int on) {
    if (on >= 0)
        gc_fp512_state = on != 0;
    return gc_fp512();
}

static int gc_has_f16c(void) { return gc_simd() >= 1; }

__attribute__((target("avx2,f16c"))) static gc_ssize gc_encode_fp16_hw(const uint32_t *u, uint16_t *w, gc_ssize m,
                                                                        uint32_t *flag) {
    gc_ssize i = 0;
    __m256i fv = _mm256_setzero_si256();
    const __m256i e = _mm256_set1_epi16(0x7c00), ulp = _mm256_set1_epi16(0x0400);
    for (; i + 16 <= m; i += 16) {
        __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps((const float *)(u + i)), _MM_FROUND_TO_NEAREST_INT);
        __m128i hi = _mm256_cvtps_ph(_mm256_loadu_ps((const float *)(u + i + 8)), _MM_FROUND_TO_NEAREST_INT);
        __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        _mm256_storeu_si256((__m256i *)(w + i), h);
        fv = _mm256_or_si256(fv, _mm256_add_epi16(_mm256_and_si256(h, e), ulp));
    }
    if ((unsigned)_mm256_movemask_epi8(fv) & 0xaaaaaaaau)  /* the top bit of a 16-bit lane: an Inf/NaN */
        *flag |= 0x8000u;
    return i;
}

/* The 8-lane accumulate of the wire kernels: acc = finish(acc + x) (acc = x when DECODE_ONLY) with x = WIDEN (the
 * 8 values at w + i as float32); ORs the finite check's top bit into flag and returns how many it did. */
#define GC_ACC_HW_LOOP(WIDEN, DECODE_ONLY)                                                                     \
    gc_ssize i = 0;                                                                                            \
    __m256i fv = _mm256_setzero_si256();                                                                       \
    const __m256i e = _mm256_set1_epi32((int)GC_EXP32), ulp = _mm256_set1_epi32((int)GC_ULP32);               \
    const __m256 vd = _mm256_set1_ps(d);                                                                       \
    for (; i + 8 <= m; i += 8) {                                                                               \
        __m256 x = (WIDEN);                                                                                    \
        __m256 s = (DECODE_ONLY) ? x : _mm256_add_ps(_mm256_loadu_ps(acc + i), x);                            \
        if (mode == GC_MUL) s = _mm256_mul_ps(s, vd);                                                          \
        else if (mode == GC_DIV) s = _mm256_div_ps(s, vd);                                                     \
        _mm256_storeu_ps(acc + i, s);                                                                          \
        fv = _mm256_or_si256(fv, _mm256_add_epi32(_mm256_and_si256(_mm256_castps_si256(s), e), ulp));         \
    }                                                                                                          \
    if ((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(fv)))  /* the sign bit of a lane: an Inf/NaN */      \
        *flag |= GC_TOP32;                                                                                     \
    return i;

__attribute__((target("avx2,f16c"))) static gc_ssize gc_acc_fp16_hw(float *acc, const uint16_t *w, gc_ssize m,
                                                                     float d, int mode, uint32_t *flag) {
    GC_ACC_HW_LOOP(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))), 0)
}

/* bf16 widens by a shift into the top half of each float32 (gc_acc_bf16_512's steps with AVX2). */
__attribute__((target("avx2"))) static gc_ssize gc_acc_bf16_hw(float *acc, const uint16_t *w, gc_ssize m, float d,
                                                                int mode, int decode_only, uint32_t *flag) {
    GC_ACC_HW_LOOP(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
        _mm_loadu_si128((const __m128i *)(w + i))), 16)), decode_only)
}

/* gc_bf16 on 16 lanes at a time, with the NaN select: a signed comparison for the NaN test (|u| fits in 31
 * bits) and one saturating pack (every value fits in 16 bits) in place of the compiler's narrowing shuffles. */
__attribute__((target("avx2"))) static void gc_encode_bf16_sel_hw(const uint32_t *u, uint16_t *w, gc_ssize m) {
    gc_ssize i = 0;
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
    __m256i r[2];
    int k;
    for (; i + 16 <= m; i += 16) {
        for (k = 0; k < 2; k++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(u + i + 8 * k));
            __m256i top = _mm256_srli_epi32(v, 16);
            __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, half),
                                                                 _mm256_and_si256(top, one)), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs), inf);
            r[k] = _mm256_blendv_epi8(rounded, _mm256_or_si256(top, quiet), nan);
        }
        _mm256_storeu_si256((__m256i *)(w + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8));
    }
}

/* The encode as it runs: every value rounded as a number (no NaN select, a third fewer instructions), and
 * the largest input magnitude kept (an unsigned maximum). An encoded value has an all-ones exponent exactly
 * when its input's magnitude bits are at least GC_BF16_TOO_BIG (Inf, NaN, and the finite values that round up
 * to Inf); only then can the select change a value, so only then does the loop run again with it. */
#define GC_BF16_TOO_BIG 0x7f7f8000u
__attribute__((target("avx2"))) static gc_ssize gc_encode_bf16_hw(const uint32_t *u, uint16_t *w, gc_ssize m,
                                                                   uint32_t *flag) {
    gc_ssize i = 0;
    __m256i mx = _mm256_setzero_si256();
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m256i r[2];
    uint32_t lanes[8], top = 0;
    int k;
    for (; i + 16 <= m; i += 16) {
        /* a line 4 KiB ahead: out of L2 (with AVX-512 this loop runs from GC_ENCODE_512_MAX elements) the
         * hardware prefetcher alone leaves the serial encode short of the streaming loop; with it the encode
         * keeps up, and in cache it changes nothing (docs/kernels.md, "Aligned stores and a cheaper
         * check") */
        _mm_prefetch((const char *)(u + i + 1024), _MM_HINT_T0);
        for (k = 0; k < 2; k++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(u + i + 8 * k));
            r[k] = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, half),
                                                      _mm256_and_si256(_mm256_srli_epi32(v, 16), one)), 16);
            mx = _mm256_max_epu32(mx, _mm256_and_si256(v, abs));
        }
        _mm256_storeu_si256((__m256i *)(w + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8));
    }
    _mm256_storeu_si256((__m256i *)lanes, mx);
    for (k = 0; k < 8; k++)
        top = lanes[k] > top ? lanes[k] : top;
    if (top >= GC_BF16_TOO_BIG) {  /* an Inf or NaN: the call fails; dst gets the oracle's bits all the same */
        gc_encode_bf16_sel_hw(u, w, i);
        *flag |= 0x8000u;
    }
    return i;
}
#include "_wide.h"
#else
static int gc_set_simd_cap(int cap) { (void)cap; return 0; }  /* no vector loops of their own here */
static int gc_set_fp512(int on) { (void)on; return 0; }
#endif

/* The float32 accumulate: the AVX-512 loop first where the CPU has it and the call is below GC_ACC_512_MAX
 * elements, then the AVX2/SSE2 one for the rest (docs/kernels.md, "The accumulate's mode"). */
#if defined(GC_F16C)
static int gc_acc_f(float *acc, const float *x, gc_ssize m, float d, int mode, float sc, int doscale) {
    gc_ssize i = 0;
    uint32_t flag = 0;
    int ok = 1;
    if (m < GC_ACC_512_MAX && gc_simd_fp() >= 2) {
        i = gc_head(acc, sizeof(float), m);  /* up to an aligned accumulator, as the loop below does */
        ok = gc_acc_f_base(acc, x, i, d, mode, sc, doscale);
        i += gc_acc_f_512(acc + i, x + i, m - i, d, mode, sc, doscale, &flag);
    }
    return gc_acc_f_base(acc + i, x + i, m - i, d, mode, sc, doscale) && ok && (flag & GC_TOP32) == 0;
}
#else
#define gc_acc_f gc_acc_f_base
#endif

/* One encode: the widest vector loop the CPU has, then the scalar conversion for the rest; 1 when every
 * encoded value is finite (EXP: the format's exponent bits, ULP: their lowest bit). */
#if defined(GC_F16C)
#define GC_ENCODE_HW_BF16 i = gc_encode_bf16_vec(u, w, m, &flag);
#define GC_ENCODE_HW_FP16 i = gc_encode_fp16_vec(u, w, m, &flag);
#else
#define GC_ENCODE_HW_BF16
#define GC_ENCODE_HW_FP16
#endif
#define GC_DEFINE_ENCODE(NAME, CONV, HWLOOP, EXP, ULP)                                                 \
    GC_CLONES static int NAME(const uint32_t *restrict u, uint16_t *restrict w, gc_ssize m) {          \
        gc_ssize i = 0;                                                                                \
        uint32_t flag = 0, v;                                                                          \
        HWLOOP                                                                                         \
        for (; i < m; i++) {                                                                           \
            v = CONV(u[i]);                                                                            \
            w[i] = (uint16_t)v;                                                                        \
            flag |= (v & (EXP)) + (ULP);                                                               \
        }                                                                                              \
        return (flag & 0x8000u) == 0;                                                                  \
    }

GC_DEFINE_ENCODE(gc_encode_bf16, gc_bf16, GC_ENCODE_HW_BF16, 0x7f80u, 0x0080u)
GC_DEFINE_ENCODE(gc_encode_fp16, gc_fp16, GC_ENCODE_HW_FP16, 0x7c00u, 0x0400u)

/* acc = finish(acc + decode(w)), or acc = decode(w) when decode_only; 1 when every result is finite.
 * bf16 widens by a shift; fp16 reads the 65,536-entry table of float32 values. */
GC_CLONES static int gc_acc_bf16(float *restrict acc, const uint16_t *restrict w, gc_ssize m, float d, int mode,
                                 int decode_only) {
    gc_ssize i = 0;
    uint32_t flag = 0, b;
    float x, s;
#if defined(GC_F16C)
    if (gc_simd_fp() >= 2)
        i = gc_acc_bf16_512(acc, w, m, d, mode, decode_only, &flag);
    if (gc_simd() >= 1)
        i += gc_acc_bf16_hw(acc + i, w + i, m - i, d, mode, decode_only, &flag);
#endif
    for (; i < m; i++) {
        b = (uint32_t)w[i] << 16;
        memcpy(&x, &b, 4);
        s = decode_only ? x : acc[i] + x;
        if (mode == GC_MUL) s *= d; else if (mode == GC_DIV) s /= d;
        acc[i] = s;
        flag |= gc_flag32(s);
    }
    return (flag & GC_TOP32) == 0;
}

/* dst = widen(w) with no finite check: the decode of values already checked (a wire collective's results),
 * 16 a time with AVX2; the same bits as gc_acc_bf16's decode_only. */
#if defined(GC_F16C)
__attribute__((target("avx2"), unused)) static gc_ssize gc_widen_bf16_hw(float *dst, const uint16_t *w, gc_ssize m) {
    gc_ssize i = 0;
    for (; i + 16 <= m; i += 16) {
        __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i)));
        __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i + 8)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(lo, 16));
        _mm256_storeu_si256((__m256i *)(dst + i + 8), _mm256_slli_epi32(hi, 16));
    }
    return i;
}
#endif
__attribute__((unused)) static void gc_widen_bf16(float *restrict dst, const uint16_t *restrict w, gc_ssize m) {
    gc_ssize i = 0;
    uint32_t b;
#if defined(GC_F16C)
    if (gc_simd() >= 1)
        i = gc_widen_bf16_hw(dst, w, m);
#endif
    for (; i < m; i++) {
        b = (uint32_t)w[i] << 16;
        memcpy(dst + i, &b, 4);
    }
}

/* dst = widen(w) for fp16 values that are never a signalling NaN (a rounding's results; vcvtph2ps would quiet
 * one), with no finite check: vcvtph2ps 16 a time, the table for the rest. */
#if defined(GC_F16C)
__attribute__((target("avx2,f16c"), unused)) static gc_ssize gc_widen_fp16_hw(float *dst, const uint16_t *w,
                                                                              gc_ssize m) {
    gc_ssize i = 0;
    for (; i + 16 <= m; i += 16) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))));
        _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8))));
    }
    return i;
}
#endif
__attribute__((unused)) static void gc_widen_fp16(float *restrict dst, const uint16_t *restrict w,
                                                  const float *restrict table, gc_ssize m) {
    gc_ssize i = 0;
#if defined(GC_F16C)
    if (gc_simd() >= 1)
        i = gc_widen_fp16_hw(dst, w, m);
#endif
    for (; i < m; i++)
        dst[i] = table[w[i]];
}

GC_CLONES static int gc_acc_fp16(float *restrict acc, const uint16_t *restrict w, const float *restrict table,
                                 gc_ssize m, float d, int mode, int decode_only) {
    gc_ssize i = 0;
    uint32_t flag = 0;
    float s;
#if defined(GC_F16C)
    if (!decode_only && gc_simd_fp() >= 2)
        i = gc_acc_fp16_512(acc, w, m, d, mode, &flag);
    if (!decode_only && gc_has_f16c())
        i += gc_acc_fp16_hw(acc + i, w + i, m - i, d, mode, &flag);
#endif
    for (; i < m; i++) {
        s = decode_only ? table[w[i]] : acc[i] + table[w[i]];
        if (mode == GC_MUL) s *= d; else if (mode == GC_DIV) s /= d;
        acc[i] = s;
        flag |= gc_flag32(s);
    }
    return (flag & GC_TOP32) == 0;
}

#endif /* GRADCOLL_FUSED_H */
