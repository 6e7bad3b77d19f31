/* cblas_sgemm for MLX on Linux: products over few rows in the shape OpenBLAS
 * computes fastest. blas.py compiles this file, loads it before OpenBLAS (so
 * that MLX's cblas_sgemm binds here) and hands it OpenBLAS's functions with
 * few_rows_use(). Every other product goes to OpenBLAS's cblas_sgemm as it is.
 *
 * MLX computes every float32 product with cblas_sgemm, one-row ones too, and
 * a batched product (attention's, per row and head) as one call per matrix.
 * Measured on a Zen 5 EPYC, OpenBLAS 0.3.33 on 2 threads (docs/benchmarks.md,
 * "Few-row products"; the same pattern under its Haswell kernels):
 *
 * - Tiny products (one token's attention scores over 60 keys: 3,840
 *   multiply-adds) cost more in OpenBLAS's call than in arithmetic; computed
 *   here, 16 lanes at a time, 512 of them took 168 us instead of 451.
 * - One or two rows: OpenBLAS first copies the whole weight into its packed
 *   layout. sgemv reads it once, where it lies: x W^T for W 8192 x 256 took
 *   214 us per row instead of 363 (one row) and 303 instead of 450 (two).
 * - Other row counts that are not a multiple of 8: slower than the next
 *   multiple of 8 (6 rows 694 us, 8 rows 384; 14 rows 838, 16 rows 538),
 *   so they are computed as that many, the extra rows zero.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef void (*sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c,
                         int ldc);
typedef void (*sgemv_fn)(int order, int trans, int m, int n, float alpha, const float *a, int lda,
                         const float *x, int incx, float beta, float *y, int incy);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Products of at most this many multiply-adds are computed here: OpenBLAS's
 * call overhead dominates them. */
#define TINY_SIZE (1 << 17)
/* Up to this many rows, one sgemv per row. */
#define VECTOR_ROWS 2
/* Row counts below this are padded to a multiple of ROW_MULTIPLE... */
#define PADDED_ROWS 64
#define ROW_MULTIPLE 8
/* ...when B has at least this many values: padding small products costs more than it saves. */
#define PADDED_MIN_SIZE (1 << 16)

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;

/* Products taken by each path: tiny, by rows of sgemv, padded, passed on as they are. */
enum { TINY, BY_ROWS, PADDED, PASSED_ON };
atomic_long few_rows_counts[4];

void few_rows_use(sgemm_fn sgemm, sgemv_fn sgemv) {
    blas_sgemm = sgemm;
    blas_sgemv = sgemv;
}

#define LANES 16

/* C = alpha op(A) op(B) + beta C, computed here. */
static void tiny(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
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

/* C = alpha op(A) op(B) + beta C, row by row: row i of C is op(B)^T times row i of op(A). */
static void by_rows(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                    int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    /* Row i of op(A): a row of A, or a column of A when A is transposed. */
    long row_step = trans_a == NO_TRANS ? lda : 1;
    int a_stride = trans_a == NO_TRANS ? 1 : lda;
    for (int i = 0; i < m; i++) {
        const float *x = a + i * row_step;
        float *y = c + (long)i * ldc;
        if (trans_b == NO_TRANS) /* B is k x n: y = B^T x */
            blas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, x, a_stride, beta, y, 1);
        else /* B is n x k: y = B x */
            blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, x, a_stride, beta, y, 1);
    }
}

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
    if (order == ROW_MAJOR && m <= VECTOR_ROWS && m > 0 && n > 0 && k > 0) {
        atomic_fetch_add(&few_rows_counts[BY_ROWS], 1);
        by_rows(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (order == ROW_MAJOR && trans_a == NO_TRANS && m < PADDED_ROWS && m % ROW_MULTIPLE != 0 &&
        (long)n * k >= PADDED_MIN_SIZE &&
        padded(trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
        atomic_fetch_add(&few_rows_counts[PADDED], 1);
        return;
    }
    atomic_fetch_add(&few_rows_counts[PASSED_ON], 1);
    blas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
