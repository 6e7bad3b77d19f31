/* cblas_sgemm for MLX on Linux: products over few rows in the shape OpenBLAS
 * computes fastest. blas.py compiles this file, loads it before OpenBLAS (so
 * that MLX's cblas_sgemm binds here) and hands it OpenBLAS's functions with
 * few_rows_use(). Every other product goes to OpenBLAS's cblas_sgemm as it is.
 *
 * MLX computes every float32 product with cblas_sgemm, one-row ones too, and
 * a batched product (attention's, per row and head) as one call per matrix.
 * Measured with OpenBLAS 0.3.33 on 2 threads (docs/benchmarks.md, "Few-row
 * products"):
 *
 * - Tiny products (one token's attention scores over 60 keys: 3,840
 *   multiply-adds) cost more in OpenBLAS's call than in arithmetic; computed
 *   here, 16 lanes at a time, 512 of them took 168 us instead of 451 (Zen 5).
 * - Few rows: OpenBLAS first copies the whole of B into its packed layout.
 *   Streamed instead, each of OpenBLAS's threads reading its share of B once,
 *   where it lies (as its sgemv does): on a Zen 5, x W^T for W 8192 x 256
 *   took 210 us instead of 315-373 at one row; on a Zen 4, W 256 x 8192 at
 *   16 rows 445-466 instead of 1075-1106, and a weight stored transposed (B
 *   not transposed), W 8192 x 256 at 8 rows, 407-439 instead of 875-927.
 * - Other row counts that are not a multiple of 8: slower than the next
 *   multiple of 8 (6 rows 694 us, 8 rows 384; 14 rows 838, 16 rows 538),
 *   so they are computed as that many, the extra rows zero.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef void (*sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c,
                         int ldc);
typedef void (*sgemv_fn)(int order, int trans, int m, int n, float alpha, const float *a, int lda,
                         const float *x, int incx, float beta, float *y, int incy);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Products of at most this many multiply-adds are computed here: OpenBLAS's
 * call overhead dominates them. */
#define TINY_SIZE (1 << 17)
/* A B^T over up to this many rows streams B once, split between the threads:
 * up to STREAMED_ROWS when B's rows are at least LONG_ROWS long, else up to
 * SHORT_STREAMED_ROWS (each output's sum ends with a reduction across lanes,
 * which over short rows costs as much as their multiply-adds at 3 or 4
 * rows). For B 256 x 8192 on a Zen 4 it took 0.4-0.6x OpenBLAS's time at 12
 * to 32 rows, 0.9-0.96x at 96 and 128, and 1.08x at 256. */
#define STREAMED_ROWS 128
#define SHORT_STREAMED_ROWS 2
#define LONG_ROWS 1024
/* A B (B as it lies, k x n) over up to this many rows is broadcast: each
 * element of A times 16 columns of a row of B, no reduction at all. For B
 * 256 x 8192 on a Zen 4 it took 0.36-0.8x OpenBLAS's time at 4 to 32 rows,
 * 0.71-0.86x at 48 and 64. */
#define BROADCAST_MAX_ROWS 64
/* The broadcast kernel sums this many rows of B in registers before it
 * stores its partial sums: that many streams of memory at a time. Up to
 * BROADCAST_FEW_ROWS rows of A, memory bounds the product and 16 streams
 * read it fastest; over more, storing and reloading the sums does, and
 * blocks of 128 rows took 0.6-0.9x the time. */
#define BROADCAST_BLOCK 16
#define BROADCAST_LONG_BLOCK 128
#define BROADCAST_FEW_ROWS 8
/* ...and asks for each of its rows this many columns ahead, into L2: the
 * hardware's prefetchers do not follow that many streams far enough. Cold
 * weights on a Zen 4, 8192 x 256 stored transposed: 0.9x the time at 8 rows,
 * 0.72x at 24; the 3000 x 256 embedding 0.67x at 8 (none at 64 columns
 * ahead, one tile: too late). */
#define BROADCAST_PREFETCH 128
/* The streamed kernel reads B in blocks of this many values, which stay in
 * the core's cache while each group of 4 rows of A reads them. */
#define STREAMED_BLOCK (1 << 16)

/* The kernels keep 4 x 4 sums of 16 lanes in registers: AVX-512 has
 * 32 of them, AVX2 16 of half the width (built for AVX2 it took 1.7x the time
 * of OpenBLAS's sgemv at one row). Without AVX-512, or without OpenBLAS's
 * thread pool, up to SHORT_STREAMED_ROWS rows are computed by one sgemv each
 * instead, which also reads B where it lies. */
#ifdef __AVX512F__
#define OWN_KERNEL (blas_pool != NULL)
#else
#define OWN_KERNEL 0
#endif
/* Row counts below this are padded to a multiple of ROW_MULTIPLE... */
#define PADDED_ROWS 64
#define ROW_MULTIPLE 8
/* ...when B has at least this many values: padding small products costs more than it saves. */
#define PADDED_MIN_SIZE (1 << 16)

/* OpenBLAS's gotoblas_pthread(): runs function(args + i stride) for i < count on
 * its own threads (the calling one included), as its sgemv does its share. */
typedef int (*pool_fn)(int count, void (*function)(void *), void *args, int stride);
#define MAX_THREADS 64

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;
static pool_fn blas_pool;

/* Products taken by each path: tiny, streamed (by the kernels below or by rows
 * of sgemv), padded, passed on as they are. */
enum { TINY, STREAMED, PADDED, PASSED_ON };
atomic_long few_rows_counts[4];
static int threads = 1;

/* Whether this build computes with its own kernels (AVX-512 and OpenBLAS's
 * thread pool): which path a product takes depends on it. */
int few_rows_own_kernels(void) { return OWN_KERNEL; }

/* OpenBLAS's cblas_sgemm, cblas_sgemv, its gotoblas_pthread (NULL: compute on
 * the calling thread alone) and its thread count. */
void few_rows_use(sgemm_fn sgemm, sgemv_fn sgemv, pool_fn pool, int num_threads) {
    blas_sgemm = sgemm;
    blas_sgemv = sgemv;
    blas_pool = pool;
    threads = num_threads < 1 ? 1 : num_threads > MAX_THREADS ? MAX_THREADS : num_threads;
}

#define LANES 16

#ifdef __AVX512F__
static inline void store_scaled(float *out, float alpha, float sum, float beta) {
    *out = (beta == 0.0f ? 0.0f : beta * *out) + alpha * sum;
}

/* C = alpha A B^T + beta C, k a multiple of 16 (A m x k, B n x k): four
 * columns at a time, so that four chains of multiply-adds run side by side
 * (one query's scores over 40 keys: 0.11 us a call instead of 0.25). */
static void tiny_dots(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                      int ldb, float beta, float *c, int ldc) {
    for (int i = 0; i < m; i++) {
        const float *x = a + (long)i * lda;
        float *y = c + (long)i * ldc;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            const float *rows = b + (long)j * ldb;
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int l = 0; l < k; l += 16) {
                __m512 x_lanes = _mm512_loadu_ps(x + l);
                s0 = _mm512_fmadd_ps(x_lanes, _mm512_loadu_ps(rows + l), s0);
                s1 = _mm512_fmadd_ps(x_lanes, _mm512_loadu_ps(rows + ldb + l), s1);
                s2 = _mm512_fmadd_ps(x_lanes, _mm512_loadu_ps(rows + 2L * ldb + l), s2);
                s3 = _mm512_fmadd_ps(x_lanes, _mm512_loadu_ps(rows + 3L * ldb + l), s3);
            }
            store_scaled(y + j, alpha, _mm512_reduce_add_ps(s0), beta);
            store_scaled(y + j + 1, alpha, _mm512_reduce_add_ps(s1), beta);
            store_scaled(y + j + 2, alpha, _mm512_reduce_add_ps(s2), beta);
            store_scaled(y + j + 3, alpha, _mm512_reduce_add_ps(s3), beta);
        }
        for (; j < n; j++) {
            __m512 sum = _mm512_setzero_ps();
            for (int l = 0; l < k; l += 16)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(x + l), _mm512_loadu_ps(b + (long)j * ldb + l),
                                      sum);
            store_scaled(y + j, alpha, _mm512_reduce_add_ps(sum), beta);
        }
    }
}

/* One thread's share of a product of the kernels below: columns j0 .. j1 - 1. */
struct share {
    int m, k, lda, ldb, ldc, j0, j1;
    float alpha, beta;
    const float *a, *b;
    float *c;
};

static void compute_broadcast_share(void *argument);

/* Attention's tiny products come one per (row, head) matrix, in MLX's loop
 * over them, each B a fixed step past the last. Cached keys and values are
 * slices of a larger storage, so consecutive matrices lie apart, and the
 * hardware's prefetchers start again at each one: read so, they took about
 * twice as long as contiguous ones. Once two steps agree and leave a gap,
 * the next matrix's first NEXT_MATRIX_PREFETCH bytes are asked for into L2
 * while this one is computed. A wrong guess only reads memory in vain. */
#define NEXT_MATRIX_PREFETCH (16 << 10)
static __thread uintptr_t last_b, last_step;

static inline void prefetch_next_matrix(const float *b, long span) {
    uintptr_t step = (uintptr_t)b - last_b;
    long bytes = span * (long)sizeof(float);
    if (step == last_step && step > (uintptr_t)bytes) {
        const char *next = (const char *)b + step;
        if (bytes > NEXT_MATRIX_PREFETCH)
            bytes = NEXT_MATRIX_PREFETCH;
        for (long offset = 0; offset < bytes; offset += 64)
            _mm_prefetch(next + offset, _MM_HINT_T1);
    }
    last_b = (uintptr_t)b;
    last_step = step;
}
#endif

/* C = alpha op(A) op(B) + beta C, computed here. */
static void tiny(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
#ifdef __AVX512F__
    /* Attention of a few queries: scores over the keys, then weighted values,
     * per row and head, each a call of its own. */
    if (trans_a == NO_TRANS && trans_b == TRANS && k % 16 == 0) {
        prefetch_next_matrix(b, (long)(n - 1) * ldb + k); /* B: n rows of k */
        tiny_dots(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (trans_a == NO_TRANS && trans_b == NO_TRANS && beta == 0.0f && n % 16 == 0) {
        /* The broadcast kernel on this thread alone (one query's weighted
         * values over 40 keys: 0.09-0.12 us a call instead of 0.20). */
        struct share product = {m, k, lda, ldb, ldc, 0, n, alpha, 0.0f, a, b, c};
        prefetch_next_matrix(b, (long)(k - 1) * ldb + n); /* B: k rows of n */
        compute_broadcast_share(&product);
        return;
    }
#endif
    long row_step = trans_a == NO_TRANS ? lda : 1;
    long a_stride = trans_a == NO_TRANS ? 1 : lda;
    for (int i = 0; i < m; i++) {
        const float *x = a + i * row_step;
        float *y = c + (long)i * ldc;
        if (trans_b == NO_TRANS) { /* B is k x n: y = beta y + alpha x B, row by row of B */
            for (int j = 0; j < n; j++)
                y[j] = beta == 0.0f ? 0.0f : beta * y[j];
            for (int l = 0; l < k; l++) {
                float scale = alpha * x[l * a_stride];
                const float *b_row = b + (long)l * ldb;
                for (int j = 0; j < n; j++)
                    y[j] += scale * b_row[j];
            }
        } else { /* B is n x k: y_j = beta y_j + alpha (x . row j of B) */
            for (int j = 0; j < n; j++) {
                const float *b_row = b + (long)j * ldb;
                float lanes[LANES] = {0};
                int l = 0;
                if (a_stride == 1)
                    for (; l + LANES <= k; l += LANES)
                        for (int v = 0; v < LANES; v++)
                            lanes[v] += x[l + v] * b_row[l + v];
                float sum = 0.0f;
                for (int v = 0; v < LANES; v++)
                    sum += lanes[v];
                for (; l < k; l++)
                    sum += x[l * a_stride] * b_row[l];
                y[j] = (beta == 0.0f ? 0.0f : beta * y[j]) + alpha * sum;
            }
        }
    }
}

#ifdef __AVX512F__
typedef float lanes16 __attribute__((vector_size(64)));

static inline lanes16 load16(const float *p) {
    lanes16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline float sum16(lanes16 x) { return _mm512_reduce_add_ps((__m512)x); }

/* Columns j .. j + 3 of C = alpha A B^T + beta C over m <= 4 rows:
 * the four rows of B are read once, each in step with the m rows of A. */
static inline __attribute__((always_inline)) void four_columns(
    const int m, int j, int k, float alpha, const float *a, long lda, const float *b, long ldb,
    float beta, float *c, long ldc) {
    lanes16 sums[4][4];
    for (int o = 0; o < 4; o++)
        for (int i = 0; i < m; i++)
            sums[o][i] = (lanes16){0};
    const float *rows = b + j * ldb;
    int l = 0;
    for (; l + 16 <= k; l += 16) {
        lanes16 column[4];
        /* Each vector in a register (see tile()): GCC would otherwise load
         * every row of A once per row of B, 32 loads per 16 multiply-adds
         * instead of 8 (2-2.4x the time at 4 to 16 rows, in cache). */
        for (int o = 0; o < 4; o++) {
            column[o] = load16(rows + o * ldb + l);
            __asm__("" : "+v"(column[o]));
        }
        for (int i = 0; i < m; i++) {
            lanes16 x = load16(a + i * lda + l);
            __asm__("" : "+v"(x));
            for (int o = 0; o < 4; o++)
                sums[o][i] += x * column[o];
        }
    }
    for (int i = 0; i < m; i++)
        for (int o = 0; o < 4; o++) {
            float sum = sum16(sums[o][i]);
            for (int t = l; t < k; t++)
                sum += a[i * lda + t] * rows[o * ldb + t];
            float *out = c + i * ldc + j + o;
            *out = (beta == 0.0f ? 0.0f : beta * *out) + alpha * sum;
        }
}

/* Columns j0 .. j1 - 1 (a multiple of 4 apart) of the streamed product, m rows. */
static inline __attribute__((always_inline)) void columns(
    const int m, int j0, int j1, int k, float alpha, const float *a, long lda, const float *b,
    long ldb, float beta, float *c, long ldc) {
    for (int j = j0; j < j1; j += 4)
        four_columns(m, j, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static void compute_share(void *argument) {
    const struct share *s = argument;
    /* B comes from memory once, whatever m: see STREAMED_BLOCK. */
    int block = STREAMED_BLOCK / s->k / 4 * 4;
    if (block < 4)
        block = 4;
    for (int j = s->j0; j < s->j1; j += block) {
        int j1 = j + block < s->j1 ? j + block : s->j1;
        for (int i = 0; i < s->m; i += 4) {
            const float *a = s->a + (long)i * s->lda;
            float *c = s->c + (long)i * s->ldc;
            switch (s->m - i) { /* a constant row count in each case: its sums stay in registers */
            case 1: columns(1, j, j1, s->k, s->alpha, a, s->lda, s->b, s->ldb, s->beta, c, s->ldc); break;
            case 2: columns(2, j, j1, s->k, s->alpha, a, s->lda, s->b, s->ldb, s->beta, c, s->ldc); break;
            case 3: columns(3, j, j1, s->k, s->alpha, a, s->lda, s->b, s->ldb, s->beta, c, s->ldc); break;
            default: columns(4, j, j1, s->k, s->alpha, a, s->lda, s->b, s->ldb, s->beta, c, s->ldc);
            }
        }
    }
}

/* Runs compute() on OpenBLAS's threads, each over its share of ``units``
 * blocks of ``width`` columns of ``product`` (j0 .. j1 - 1). */
static void run_shares(void (*compute)(void *), struct share product, int units, int width) {
    struct share shares[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        shares[t] = product;
        shares[t].j0 = width * (int)((long)units * t / threads);
        shares[t].j1 = width * (int)((long)units * (t + 1) / threads);
    }
    if (threads > 1)
        blas_pool(threads, compute, shares, sizeof shares[0]);
    else
        compute(shares);
}

/* C = alpha A B^T + beta C for m <= STREAMED_ROWS rows, B n x k: each of
 * OpenBLAS's threads streams its share of B's rows once (sgemm would first
 * copy all of B into its packed layout); the last n % 4 columns go to tiny(). */
static void streamed(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                     int ldb, float beta, float *c, int ldc) {
    struct share product = {m, k, lda, ldb, ldc, 0, 0, alpha, beta, a, b, c};
    run_shares(compute_share, product, n / 4, 4);
    if (n % 4)
        tiny(NO_TRANS, TRANS, m, n % 4, k, alpha, a, lda, b + (long)(n - n % 4) * ldb, ldb, beta,
             c + (n - n % 4), ldc);
}

/* Columns j .. j + 16 vectors - 1 of C over m <= 4 rows, from B's rows
 * l0 .. l1 - 1 (B k x n, not transposed): each row of B is broadcast-multiplied
 * into sums of 16 columns, so no sum needs reducing across lanes. The sums
 * start from C's partial sums (zero for the first rows of B) and get alpha
 * at the last. */
static inline __attribute__((always_inline)) void tile(const int m, const int vectors, int j,
                                                       int l0, int l1, float alpha,
                                                       const float *a, long lda, const float *b,
                                                       long ldb, float *c, long ldc, int k) {
    lanes16 sums[4][4];
    for (int i = 0; i < m; i++)
        for (int t = 0; t < vectors; t++)
            sums[i][t] = l0 == 0 ? (lanes16){0} : load16(c + i * ldc + j + 16 * t);
    for (int l = l0; l < l1; l++) {
        const float *b_row = b + l * ldb + j;
        lanes16 column[4];
        for (int t = 0; t < vectors; t++)
            _mm_prefetch((const char *)(b_row + BROADCAST_PREFETCH + 16 * t), _MM_HINT_T1);
        for (int t = 0; t < vectors; t++) {
            column[t] = load16(b_row + 16 * t);
            /* In a register: GCC would otherwise fold the load into each
             * multiply-add, loading it m times (1.1-1.2x the time at 8-32 rows). */
            __asm__("" : "+v"(column[t]));
        }
        for (int i = 0; i < m; i++) {
            lanes16 x = (lanes16)_mm512_set1_ps(a[i * lda + l]);
            for (int t = 0; t < vectors; t++)
                sums[i][t] += x * column[t];
        }
    }
    for (int i = 0; i < m; i++)
        for (int t = 0; t < vectors; t++) {
            lanes16 sum = l1 == k ? sums[i][t] * alpha : sums[i][t];
            memcpy(c + i * ldc + j + 16 * t, &sum, sizeof sum);
        }
}

/* tile() over every row of a share, 4 rows at a time. */
static inline __attribute__((always_inline)) void tile_rows(const int vectors,
                                                            const struct share *s, int j, int l0,
                                                            int l1) {
    for (int i = 0; i < s->m; i += 4) {
        const float *a = s->a + (long)i * s->lda;
        float *c = s->c + (long)i * s->ldc;
        switch (s->m - i) { /* a constant row count in each case: its sums stay in registers */
        case 1: tile(1, vectors, j, l0, l1, s->alpha, a, s->lda, s->b, s->ldb, c, s->ldc, s->k); break;
        case 2: tile(2, vectors, j, l0, l1, s->alpha, a, s->lda, s->b, s->ldb, c, s->ldc, s->k); break;
        case 3: tile(3, vectors, j, l0, l1, s->alpha, a, s->lda, s->b, s->ldb, c, s->ldc, s->k); break;
        default: tile(4, vectors, j, l0, l1, s->alpha, a, s->lda, s->b, s->ldb, c, s->ldc, s->k);
        }
    }
}

/* One thread's share of a broadcast product: columns j0 .. j1 - 1, a multiple of 16. */
static void compute_broadcast_share(void *argument) {
    const struct share *s = argument;
    int block = s->m <= BROADCAST_FEW_ROWS ? BROADCAST_BLOCK : BROADCAST_LONG_BLOCK;
    for (int l0 = 0; l0 < s->k; l0 += block) {
        int l1 = l0 + block < s->k ? l0 + block : s->k;
        int j = s->j0;
        for (; j + 64 <= s->j1; j += 64)
            tile_rows(4, s, j, l0, l1);
        switch ((s->j1 - j) / 16) {
        case 3: tile_rows(3, s, j, l0, l1); break;
        case 2: tile_rows(2, s, j, l0, l1); break;
        case 1: tile_rows(1, s, j, l0, l1); break;
        }
    }
}

/* C = alpha A B for m <= BROADCAST_MAX_ROWS rows, B k x n: each thread
 * streams its share of B's columns once; the last n % 16 columns go to tiny(). */
static void broadcast(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                      int ldb, float *c, int ldc) {
    struct share product = {m, k, lda, ldb, ldc, 0, 0, alpha, 0.0f, a, b, c};
    run_shares(compute_broadcast_share, product, n / 16, 16);
    if (n % 16)
        tiny(NO_TRANS, NO_TRANS, m, n % 16, k, alpha, a, lda, b + (n - n % 16), ldb, 0.0f,
             c + (n - n % 16), ldc);
}
#endif

/* The product over m rows rounded up to ROW_MULTIPLE, the extra rows of op(A) zero;
 * 0 if there was no memory for the copies. */
static int padded(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                  const float *b, int ldb, float beta, float *c, int ldc) {
    int rows = (m + ROW_MULTIPLE - 1) / ROW_MULTIPLE * ROW_MULTIPLE;
    float *a_rows = calloc((size_t)rows * k, sizeof(float));
    float *c_rows = malloc((size_t)rows * n * sizeof(float));
    if (a_rows == NULL || c_rows == NULL) {
        free(a_rows);
        free(c_rows);
        return 0;
    }
    for (int i = 0; i < m; i++) {
        memcpy(a_rows + (size_t)i * k, a + (size_t)i * lda, k * sizeof(float));
        if (beta != 0.0f) /* C is read: its rows come along */
            memcpy(c_rows + (size_t)i * n, c + (size_t)i * ldc, n * sizeof(float));
    }
    blas_sgemm(ROW_MAJOR, NO_TRANS, trans_b, rows, n, k, alpha, a_rows, k, b, ldb, beta, c_rows, n);
    for (int i = 0; i < m; i++)
        memcpy(c + (size_t)i * ldc, c_rows + (size_t)i * n, n * sizeof(float));
    free(a_rows);
    free(c_rows);
    return 1;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (order == ROW_MAJOR && (long)m * n * k <= TINY_SIZE && m > 0 && n > 0 && k > 0) {
        atomic_fetch_add(&few_rows_counts[TINY], 1);
        tiny(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    int streamed_rows = OWN_KERNEL && k >= LONG_ROWS ? STREAMED_ROWS : SHORT_STREAMED_ROWS;
    if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && m > 0 &&
        m <= streamed_rows && (long)n * k >= PADDED_MIN_SIZE) {
        atomic_fetch_add(&few_rows_counts[STREAMED], 1);
#ifdef __AVX512F__
        if (OWN_KERNEL) {
            streamed(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
#endif
        for (int i = 0; i < m; i++) /* row i of C is B times row i of A */
            blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a + (long)i * lda, 1, beta,
                       c + (long)i * ldc, 1);
        return;
    }
#ifdef __AVX512F__
    if (OWN_KERNEL && order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == NO_TRANS &&
        beta == 0.0f && m > 0 && m <= BROADCAST_MAX_ROWS && n >= 16 &&
        (long)n * k >= PADDED_MIN_SIZE) {
        atomic_fetch_add(&few_rows_counts[STREAMED], 1);
        broadcast(m, n, k, alpha, a, lda, b, ldb, c, ldc);
        return;
    }
#endif
    if (order == ROW_MAJOR && trans_a == NO_TRANS && m < PADDED_ROWS && m % ROW_MULTIPLE != 0 &&
        (long)n * k >= PADDED_MIN_SIZE &&
        padded(trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
        atomic_fetch_add(&few_rows_counts[PADDED], 1);
        return;
    }
    atomic_fetch_add(&few_rows_counts[PASSED_ON], 1);
    blas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
