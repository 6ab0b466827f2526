/* The AVX-512 loops of the bf16 wire kernels, and the AVX2 wire reduction (_fused.h includes this after its
 * AVX2 loops).
 *
 * The same integer operations as the AVX2 loops, on 16 lanes in place of 8, so the same bits: the encode
 * rounds to nearest even by adding 0x7fff plus the lowest kept bit and keeps the largest input magnitude
 * (an Inf or NaN reruns the range with the NaN select), the widening shifts each value into the top half
 * of a float32. Why they exist (docs/kernels.md, "Wire kernels"): the encode is compute bound in cache with
 * AVX2 (slower than a float32 copy of the same elements), and every bf16 wire collective encodes and widens
 * each element once.
 *
 * They run where gc_simd() (in _fused.h) is 2; those with floating-point work (the accumulates, the fp16
 * conversions, the wire reduction) only where gc_simd_fp() is 2 too, which it is not on Intel CPUs.
 */
#ifndef GRADCOLL_WIDE_H
#define GRADCOLL_WIDE_H

#if defined(GC_F16C)
__attribute__((target("avx512f,avx512bw"))) static void gc_encode_bf16_sel_512(const uint32_t *u, uint16_t *w,
                                                                                gc_ssize m) {
    gc_ssize i = 0;
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
    for (; i + 16 <= m; i += 16) {
        __m512i v = _mm512_loadu_si512((const void *)(u + i));
        __m512i top = _mm512_srli_epi32(v, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, half), _mm512_and_si512(top, one)), 16);
        __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs), inf);
        r = _mm512_mask_or_epi32(r, nan, top, quiet);
        _mm256_storeu_si256((__m256i *)(w + i), _mm512_cvtepi32_epi16(r));
    }
}

/* 32 values a time; returns how many it encoded (a multiple of 32). */
__attribute__((target("avx512f,avx512bw"))) static gc_ssize gc_encode_bf16_512(const uint32_t *u, uint16_t *w,
                                                                                gc_ssize m, uint32_t *flag) {
    gc_ssize i = 0;
    __m512i mx = _mm512_setzero_si512();
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    /* packus packs within 128-bit lanes: this puts the 64-bit pieces back in element order */
    const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    for (; i + 32 <= m; i += 32) {
        __m512i v0 = _mm512_loadu_si512((const void *)(u + i)), v1 = _mm512_loadu_si512((const void *)(u + i + 16));
        __m512i r0 = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v0, half),
                                                        _mm512_and_si512(_mm512_srli_epi32(v0, 16), one)), 16);
        __m512i r1 = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v1, half),
                                                        _mm512_and_si512(_mm512_srli_epi32(v1, 16), one)), 16);
        mx = _mm512_max_epu32(mx, _mm512_max_epu32(_mm512_and_si512(v0, abs), _mm512_and_si512(v1, abs)));
        _mm512_storeu_si512((void *)(w + i), _mm512_permutexvar_epi64(order, _mm512_packus_epi32(r0, r1)));
    }
    if ((uint32_t)_mm512_reduce_max_epu32(mx) >= GC_BF16_TOO_BIG) {  /* an Inf or NaN: the call fails */
        gc_encode_bf16_sel_512(u, w, i);
        *flag |= 0x8000u;
    }
    return i;
}

/* From this many elements the bf16 encode runs the AVX2 loop: where both stream from memory the AVX-512 one,
 * even with its loads aligned, is a little slower (docs/kernels.md, "The bf16 encode's loads"). The fp16
 * encode's AVX-512 loop is not, and has no such limit. */
#define GC_ENCODE_512_MAX ((gc_ssize)1 << 21)

/* The widest encode loop, then the next one for what is left (the caller finishes the tail). The AVX-512
 * loop starts where the source is 64-byte aligned, the elements before it encoded one at a time (CONV, with
 * the format's EXP and ULP for the finite check): NumPy's large arrays begin 16 bytes into a line, and every
 * 64-byte load then spans two lines (much slower, in cache and from memory alike). From MAX elements on
 * only the AVX2 loop runs; LEVEL (gc_simd or gc_simd_fp) says whether the AVX-512 one does. */
#define GC_DEFINE_ENCODE_VEC(NAME, CONV, LOOP512, LOOP256, EXP, ULP, MAX, LEVEL)                       \
    static gc_ssize NAME(const uint32_t *u, uint16_t *w, gc_ssize m, uint32_t *flag) {                 \
        gc_ssize i = 0, head;                                                                          \
        uint32_t v;                                                                                    \
        int s = LEVEL();                                                                               \
        if (s >= 2 && m < (MAX)) {                                                                     \
            head = (gc_ssize)((((uintptr_t)0 - (uintptr_t)u) & 63u) >> 2);                             \
            if (head > m)                                                                              \
                head = m;                                                                              \
            for (; i < head; i++) {                                                                    \
                v = CONV(u[i]);                                                                        \
                w[i] = (uint16_t)v;                                                                    \
                *flag |= (v & (EXP)) + (ULP);                                                          \
            }                                                                                          \
            i += LOOP512(u + i, w + i, m - i, flag);                                                   \
        }                                                                                              \
        if (s >= 1)                                                                                    \
            i += LOOP256(u + i, w + i, m - i, flag);                                                   \
        return i;                                                                                      \
    }

GC_DEFINE_ENCODE_VEC(gc_encode_bf16_vec, gc_bf16, gc_encode_bf16_512, gc_encode_bf16_hw, 0x7f80u, 0x0080u,
                     GC_ENCODE_512_MAX, gc_simd)  /* integer work only: on every CPU that has it */

/* The fp16 encode, 16 values per conversion (the AVX2 loop's steps on 16 lanes; the same rounding, so the
 * same bits), from where the source is 64-byte aligned (as gc_encode_bf16_vec, the elements before it one
 * at a time); then the AVX2 loop for what is left (docs/kernels.md, "The bf16 encode's loads"). */
__attribute__((target("avx512f,avx2,f16c"))) static gc_ssize gc_encode_fp16_512(const uint32_t *u, uint16_t *w,
                                                                                gc_ssize m, uint32_t *flag) {
    gc_ssize i = 0;
    __m256i fv = _mm256_setzero_si256();
    const __m256i e = _mm256_set1_epi16(0x7c00), ulp = _mm256_set1_epi16(0x0400);
    for (; i + 16 <= m; i += 16) {
        __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps((const float *)(u + i)), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_si256((__m256i *)(w + i), h);
        fv = _mm256_or_si256(fv, _mm256_add_epi16(_mm256_and_si256(h, e), ulp));
    }
    if ((unsigned)_mm256_movemask_epi8(fv) & 0xaaaaaaaau)  /* the top bit of a 16-bit lane: an Inf/NaN */
        *flag |= 0x8000u;
    return i;
}

GC_DEFINE_ENCODE_VEC(gc_encode_fp16_vec, gc_fp16, gc_encode_fp16_512, gc_encode_fp16_hw, 0x7c00u, 0x0400u,
                     (gc_ssize)1 << 62, gc_simd_fp)  /* no limit; a conversion: where gc_fp512() allows */

/* The 16-lane accumulate of the wire kernels: acc = finish(acc + x) (acc = x when DECODE_ONLY) with x = WIDEN
 * (the 16 values at w + i as float32); ORs the finite check's top bit into flag and returns how many it did. */
#define GC_ACC_512_LOOP(WIDEN, DECODE_ONLY)                                                                    \
    gc_ssize i = 0;                                                                                            \
    __m512i fv = _mm512_setzero_si512();                                                                       \
    const __m512i e = _mm512_set1_epi32((int)GC_EXP32), ulp = _mm512_set1_epi32((int)GC_ULP32);               \
    const __m512 vd = _mm512_set1_ps(d);                                                                       \
    for (; i + 16 <= m; i += 16) {                                                                             \
        __m512 x = (WIDEN);                                                                                    \
        __m512 s = (DECODE_ONLY) ? x : _mm512_add_ps(_mm512_loadu_ps(acc + i), x);                            \
        if (mode == GC_MUL) s = _mm512_mul_ps(s, vd);                                                          \
        else if (mode == GC_DIV) s = _mm512_div_ps(s, vd);                                                     \
        _mm512_storeu_ps(acc + i, s);                                                                          \
        fv = _mm512_or_si512(fv, _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(s), e), ulp));         \
    }                                                                                                          \
    if (_mm512_test_epi32_mask(fv, _mm512_set1_epi32((int)GC_TOP32)))  /* the sign bit of a lane: Inf/NaN */  \
        *flag |= GC_TOP32;                                                                                     \
    return i;

/* acc = finish(acc + widen(w)) (acc = widen(w) when decode_only), 16 lanes a time; ORs the finite check's
 * top bit into flag and returns how many it did (a multiple of 16). */
__attribute__((target("avx512f,avx512bw"))) static gc_ssize gc_acc_bf16_512(float *acc, const uint16_t *w,
                                                                             gc_ssize m, float d, int mode,
                                                                             int decode_only, uint32_t *flag) {
    GC_ACC_512_LOOP(_mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i))), 16)), decode_only)
}

/* acc = finish(acc + widen(w)) for the fp16 wire, 16 lanes a time (the conversion is exact, as the table
 * lookup of the scalar loop is); ORs the finite check's top bit into flag and returns how many it did. With
 * AVX2 only (8 lanes) the serial fp16 accumulate runs well below the serial streaming loop's speed
 * (docs/kernels.md, "The fp16 accumulate"). */
__attribute__((target("avx512f"))) static gc_ssize gc_acc_fp16_512(float *acc, const uint16_t *w, gc_ssize m,
                                                                   float d, int mode, uint32_t *flag) {
    GC_ACC_512_LOOP(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i))), 0)
}

/* From this many elements the float32 accumulate runs its AVX2 loop only (docs/kernels.md, "The
 * accumulate's mode"): streaming from memory, the AVX-512 one is no faster. */
#define GC_ACC_512_MAX ((gc_ssize)1 << 21)

/* acc = scale(finish(acc + x)) for float32, 32 lanes a step (the AVX2 loop's operations in the same order,
 * so the same bits); ORs the finite check's top bit into flag and returns how many it did. */
__attribute__((target("avx512f"))) static gc_ssize gc_acc_f_512(float *acc, const float *x, gc_ssize m, float d,
                                                                int mode, float sc, int doscale, uint32_t *flag) {
    gc_ssize i = 0;
    __m512i fv = _mm512_setzero_si512();
    const __m512i e = _mm512_set1_epi32((int)GC_EXP32), ulp = _mm512_set1_epi32((int)GC_ULP32);
    const __m512 vd = _mm512_set1_ps(d), vs = _mm512_set1_ps(sc);
#define GC_ACC_F_512_LOOP(MODE, DOSCALE)                                                                         \
    for (; i + 32 <= m; i += 32) {                                                                             \
        __m512 s0 = _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(x + i));                           \
        __m512 s1 = _mm512_add_ps(_mm512_loadu_ps(acc + i + 16), _mm512_loadu_ps(x + i + 16));                 \
        if ((MODE) == GC_MUL) { s0 = _mm512_mul_ps(s0, vd); s1 = _mm512_mul_ps(s1, vd); }                      \
        else if ((MODE) == GC_DIV) { s0 = _mm512_div_ps(s0, vd); s1 = _mm512_div_ps(s1, vd); }                 \
        if (DOSCALE) { s0 = _mm512_mul_ps(s0, vs); s1 = _mm512_mul_ps(s1, vs); }                               \
        _mm512_storeu_ps(acc + i, s0);                                                                         \
        _mm512_storeu_ps(acc + i + 16, s1);                                                                    \
        fv = _mm512_or_si512(fv, _mm512_or_si512(                                                              \
            _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(s0), e), ulp),                               \
            _mm512_add_epi32(_mm512_and_si512(_mm512_castps_si512(s1), e), ulp)));                             \
    }
    if (doscale)
        GC_ACC_F_512_LOOP(mode, 1)
    else if (mode == GC_MUL)
        GC_ACC_F_512_LOOP(GC_MUL, 0)
    else if (mode == GC_DIV)
        GC_ACC_F_512_LOOP(GC_DIV, 0)
    else
        GC_ACC_F_512_LOOP(GC_NONE, 0)
#undef GC_ACC_F_512_LOOP
    if (_mm512_test_epi32_mask(fv, _mm512_set1_epi32((int)GC_TOP32)))  /* the sign bit of a lane: an Inf/NaN */
        *flag |= GC_TOP32;
    return i;
}

/* bf16 rounding of the float32 bits v (gc_bf16: nearest even, a NaN quieted), as 32-bit lanes */
#define GC_BF16_ROUND_512(v)                                                                                   \
    _mm512_mask_or_epi32(                                                                                      \
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, half), _mm512_and_si512(_mm512_srli_epi32(v, 16), one)), \
                          16),                                                                                 \
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs), inf), _mm512_srli_epi32(v, 16), quiet)

/* The wire reduction of n bf16 inputs in registers, 16 lanes a time: widen input 0, add the others in rank
 * order (the last add then divides when dodiv: (sum + x) / div; one input divides alone), round the result
 * to bf16 (gc_bf16's bits), store it into enc and its widening into dec (either may be NULL). Input ``me``
 * is the float32 ``mine`` when that is not NULL, rounded to bf16 here as its encode would. The block form
 * of the same steps (gcd_wire_reduce in _direct_c.pyx) does what is left. Returns how many it did (a
 * multiple of 16); ORs 0x8000 into flag when an encoded result is Inf or NaN. */
__attribute__((target("avx512f,avx512bw"), unused)) static gc_ssize gc_wire_reduce_bf16_512(
        const uint16_t *const *xs, int n, gc_ssize m, uint16_t *enc, float *dec, float div, int dodiv,
        const float *mine, int me, uint32_t *flag) {
    gc_ssize i = 0;
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
    const __m512i e = _mm512_set1_epi32(0x7f80), ulp = _mm512_set1_epi32(0x80);
    uint32_t db;
    memcpy(&db, &div, 4);
    /* a power of two (normal, with a normal reciprocal) divides as its reciprocal multiplies: the same
       correctly rounded value, at a fraction of a division's cost */
    const int mul = (db & 0x807fffffu) == 0 && (db >> 23) > 0 && (db >> 23) < 253;
    const __m512 vd = _mm512_set1_ps(mul ? 1.0f / div : div);
    __m512i fv = _mm512_setzero_si512();
    int r, own = mine != NULL ? me : -1;
#define GC_INPUT16(r)                                                                                          \
    ((r) == own ? _mm512_castsi512_ps(_mm512_slli_epi32(                                                       \
                      GC_BF16_ROUND_512(_mm512_loadu_si512((const void *)(mine + i))), 16))                     \
                : _mm512_castsi512_ps(_mm512_slli_epi32(                                                       \
                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xs[r] + i))), 16)))
    for (; i + 16 <= m; i += 16) {
        __m512 s = GC_INPUT16(0);
        for (r = 1; r < n; r++)
            s = _mm512_add_ps(s, GC_INPUT16(r));
        if (dodiv)
            s = mul ? _mm512_mul_ps(s, vd) : _mm512_div_ps(s, vd);
        __m512i v = _mm512_castps_si512(s);
        __m512i q = GC_BF16_ROUND_512(v);
        fv = _mm512_or_si512(fv, _mm512_add_epi32(_mm512_and_si512(q, e), ulp));
        if (enc != NULL)
            _mm256_storeu_si256((__m256i *)(enc + i), _mm512_cvtepi32_epi16(q));
        if (dec != NULL)
            _mm512_storeu_ps(dec + i, _mm512_castsi512_ps(_mm512_slli_epi32(q, 16)));
    }
#undef GC_INPUT16
    if (_mm512_test_epi32_mask(fv, _mm512_set1_epi32(0x8000)))
        *flag |= 0x8000u;
    return i;
}

/* The same wire reduction with AVX2, 8 lanes a time: the rounding is gc_encode_bf16_sel_hw's (a signed
 * comparison for the NaN test, one blend), and the 8 results pack to 16 bits in order with one saturating
 * pack of the two 128-bit halves. Same bits as the 512-bit loop and the block form. */
#define GC_BF16_ROUND_256(v)                                                                                   \
    _mm256_blendv_epi8(GC_BF16_NUMBER_256(v), _mm256_or_si256(_mm256_srli_epi32(v, 16), quiet),             \
                       _mm256_cmpgt_epi32(_mm256_and_si256(v, abs), inf))
/* the rounding of a number (no NaN select): a NaN's bits can come out wrong, an Inf's and a finite value's
   are gc_bf16's */
#define GC_BF16_NUMBER_256(v)                                                                                  \
    _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, half), _mm256_and_si256(_mm256_srli_epi32(v, 16), one)), 16)

/* One pass of the AVX2 wire reduction over the 8-lane groups of [0, m). sel: round with the NaN select and
 * keep the finite check of the results (keep's 0x8000 bits), or (sel 0) round as numbers and keep the largest
 * magnitude of the results and of mine's values (an unsigned maximum). Returns how many it did. */
__attribute__((target("avx2"), always_inline)) static inline gc_ssize gc_wire_pass_256(
        const uint16_t *const *xs, int n, gc_ssize m, uint16_t *enc, float *dec, __m256 vd, int dodiv, int mul,
        const float *mine, int own, const int sel, __m256i *keep) {
    gc_ssize i = 0;
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
    const __m256i e = _mm256_set1_epi32(0x7f80), ulp = _mm256_set1_epi32(0x80);
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u);
    __m256i k = *keep;
    int r;
    for (; i + 8 <= m; i += 8) {
        __m256 s = _mm256_setzero_ps();
        for (r = 0; r < n; r++) {
            __m256i x;
            if (r == own) {  /* this rank's float32 share, rounded to the wire as its encode would */
                __m256i u = _mm256_loadu_si256((const __m256i *)(mine + i));
                if (sel) {
                    x = _mm256_slli_epi32(GC_BF16_ROUND_256(u), 16);
                } else {  /* the rounded value widened: its top half kept in place (no shifts back and forth) */
                    x = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, half),
                                                          _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), top);
                    k = _mm256_max_epu32(k, _mm256_and_si256(u, abs));
                }
            } else {
                x = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xs[r] + i))), 16);
            }
            __m256 f = _mm256_castsi256_ps(x);
            s = r == 0 ? f : _mm256_add_ps(s, f);
        }
        if (dodiv)
            s = mul ? _mm256_mul_ps(s, vd) : _mm256_div_ps(s, vd);
        __m256i v = _mm256_castps_si256(s), q;
        if (sel) {
            q = GC_BF16_ROUND_256(v);
            k = _mm256_or_si256(k, _mm256_add_epi32(_mm256_and_si256(q, e), ulp));
        } else {
            q = GC_BF16_NUMBER_256(v);
            k = _mm256_max_epu32(k, _mm256_and_si256(v, abs));
        }
        if (enc != NULL)
            _mm_storeu_si128((__m128i *)(enc + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
        if (dec != NULL)
            _mm256_storeu_ps(dec + i, _mm256_castsi256_ps(_mm256_slli_epi32(q, 16)));
    }
    *keep = k;
    return i;
}

/* The AVX2 wire reduction: one pass rounding as numbers (a third fewer instructions per rounding), then,
 * only where a result's or mine's magnitude is at least GC_BF16_TOO_BIG (an Inf or NaN on the wire, when a
 * NaN's number rounding can be wrong), the pass again with the select, which gives the bits and sets the
 * flag. A wire input that is Inf or NaN makes its sum Inf or NaN, so the results' maximum sees it; mine is
 * kept apart because the number rounding of a NaN can give a finite value (0xffffffff gives 0). Neither
 * output may overlap an input (the callers write a result area or the caller's buffer, never a slot they
 * read). */
__attribute__((target("avx2"), unused)) static gc_ssize gc_wire_reduce_bf16_256(
        const uint16_t *const *xs, int n, gc_ssize m, uint16_t *enc, float *dec, float div, int dodiv,
        const float *mine, int me, uint32_t *flag) {
    uint32_t db, lanes[8], top = 0;
    memcpy(&db, &div, 4);
    const int mul = (db & 0x807fffffu) == 0 && (db >> 23) > 0 && (db >> 23) < 253;  /* as the 512-bit loop */
    const __m256 vd = _mm256_set1_ps(mul ? 1.0f / div : div);
    const int own = mine != NULL ? me : -1;
    __m256i keep = _mm256_setzero_si256();
    gc_ssize i;
    /* the common group sizes with n and own constants: no loop over the inputs, no test of each against own */
#define GC_PASS(N, OWN) gc_wire_pass_256(xs, N, m, enc, dec, vd, dodiv, mul, mine, OWN, 0, &keep)
#define GC_PASS_OWN(N) (own < 0 ? GC_PASS(N, -1) : own == 0 ? GC_PASS(N, 0) : own == 1 ? GC_PASS(N, 1)          \
                        : own == 2 ? GC_PASS(N, 2) : GC_PASS(N, 3))
    if (n == 2 && own < 2)
        i = GC_PASS_OWN(2);
    else if (n == 3 && own < 3)
        i = GC_PASS_OWN(3);
    else if (n == 4 && own < 4)
        i = GC_PASS_OWN(4);
    else
        i = GC_PASS(n, own);
#undef GC_PASS_OWN
#undef GC_PASS
    _mm256_storeu_si256((__m256i *)lanes, keep);
    for (int k = 0; k < 8; k++)
        top = lanes[k] > top ? lanes[k] : top;
    if (top >= GC_BF16_TOO_BIG) {
        keep = _mm256_setzero_si256();
        gc_wire_pass_256(xs, n, i, enc, dec, vd, dodiv, mul, mine, own, 1, &keep);
        if (_mm256_movemask_epi8(_mm256_and_si256(keep, _mm256_set1_epi32(0x8000))))
            *flag |= 0x8000u;
    }
    return i;
}
/* The fp16 wire reduction with AVX2 and F16C, 8 lanes a time: each input widened (vcvtph2ps), this rank's
 * float32 share rounded to fp16 and widened again (vcvtps2ph to nearest even, as gc_encode_fp16_hw), added
 * in rank order, divided as the bf16 loop divides, rounded to fp16 for enc and widened for dec. The same bits
 * as the block form: the widening quiets a signalling NaN, which the first add does there too, and a rounded
 * value is never a signalling NaN, so its widening is the table's. Returns how many it did (a multiple of
 * 8); ORs 0x8000 into flag when an encoded result is Inf or NaN. */
__attribute__((target("avx2,f16c"), unused)) static gc_ssize gc_wire_reduce_fp16_256(
        const uint16_t *const *xs, int n, gc_ssize m, uint16_t *enc, float *dec, float div, int dodiv,
        const float *mine, int me, uint32_t *flag) {
    gc_ssize i = 0;
    uint32_t db;
    memcpy(&db, &div, 4);
    const int mul = (db & 0x807fffffu) == 0 && (db >> 23) > 0 && (db >> 23) < 253;  /* as the bf16 loops */
    const __m256 vd = _mm256_set1_ps(mul ? 1.0f / div : div);
    const __m128i e = _mm_set1_epi16(0x7c00), ulp = _mm_set1_epi16(0x0400);
    __m128i fv = _mm_setzero_si128();
    int r, own = mine != NULL ? me : -1;
    for (; i + 8 <= m; i += 8) {
        __m256 s = _mm256_setzero_ps();
        for (r = 0; r < n; r++) {
            __m128i h = r == own ? _mm256_cvtps_ph(_mm256_loadu_ps(mine + i), _MM_FROUND_TO_NEAREST_INT)
                                 : _mm_loadu_si128((const __m128i *)(xs[r] + i));
            __m256 x = _mm256_cvtph_ps(h);
            s = r == 0 ? x : _mm256_add_ps(s, x);
        }
        if (dodiv)
            s = mul ? _mm256_mul_ps(s, vd) : _mm256_div_ps(s, vd);
        __m128i q = _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT);
        fv = _mm_or_si128(fv, _mm_add_epi16(_mm_and_si128(q, e), ulp));
        if (enc != NULL)
            _mm_storeu_si128((__m128i *)(enc + i), q);
        if (dec != NULL)
            _mm256_storeu_ps(dec + i, _mm256_cvtph_ps(q));
    }
    if (_mm_movemask_epi8(fv) & 0xaaaa)  /* the top bit of a 16-bit lane: an Inf/NaN */
        *flag |= 0x8000u;
    return i;
}
#endif

#endif /* GRADCOLL_WIDE_H */
