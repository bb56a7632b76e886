// The machine's ceiling for the host op's memory pattern: random rows gathered from a 2 GiB buffer
// on huge pages, with and without software prefetch, on 1 and 2 threads. Not part of the library:
// it tells whether a "% of copy bandwidth" figure of the op (docs/benchmarks.md) is limited by the
// machine or by the op. Each configuration is the median of 5 runs; one JSON object per line.
//
//   gcc -O2 -mavx2 -o build/gather_bandwidth tools/gather_bandwidth.c -lpthread
//   build/gather_bandwidth > examples/results/gather_bandwidth.jsonl
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char* buf;
static int32_t* idx;
static int row_bytes, dist;

typedef struct {
  size_t lo, hi;
  float sink;
} Work;

static void* gather(void* p) {
  Work* w = p;
  __m256 acc = _mm256_setzero_ps();
  for (size_t i = w->lo; i < w->hi; i++) {
    if (dist > 0 && i + dist < w->hi) {
      const char* next = buf + (size_t)idx[i + dist] * row_bytes;
      for (int o = 0; o < row_bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
    }
    const float* r = (const float*)(buf + (size_t)idx[i] * row_bytes);
    for (int o = 0; o < row_bytes / 4; o += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(r + o));
  }
  float t[8];
  _mm256_storeu_ps(t, acc);
  w->sink = t[0];
  return NULL;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(void) {
  const size_t bytes = (size_t)1 << 31, n = 400000;
  buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (buf == MAP_FAILED) return 1;
  madvise(buf, bytes, MADV_HUGEPAGE);
  memset(buf, 1, bytes);
  idx = malloc(n * sizeof *idx);
  const int rows[] = {128, 256, 512}, dists[] = {0, 8, 16, 32};
  for (int ri = 0; ri < 3; ri++) {
    row_bytes = rows[ri];
    const size_t nrows = bytes / row_bytes;
    srand(1);
    for (size_t i = 0; i < n; i++) idx[i] = (int32_t)(((size_t)rand() * 7919u + (size_t)rand()) % nrows);
    for (int di = 0; di < 4; di++) {
      dist = dists[di];
      for (int nt = 1; nt <= 2; nt++) {
        double t[5];
        for (int rep = 0; rep < 5; rep++) {
          pthread_t th[2];
          Work w[2];
          const double t0 = now();
          for (int k = 0; k < nt; k++) {
            w[k].lo = n * k / nt;
            w[k].hi = n * (k + 1) / nt;
            pthread_create(&th[k], NULL, gather, &w[k]);
          }
          for (int k = 0; k < nt; k++) pthread_join(th[k], NULL);
          t[rep] = now() - t0;
        }
        qsort(t, 5, sizeof t[0], cmp);
        printf("{\"row_bytes\": %d, \"prefetch_rows_ahead\": %d, \"threads\": %d, \"GBps_median\": %.3f, "
               "\"GBps_min\": %.3f, \"GBps_max\": %.3f}\n",
               row_bytes, dist, nt, n * (double)row_bytes / t[2] / 1e9, n * (double)row_bytes / t[4] / 1e9,
               n * (double)row_bytes / t[0] / 1e9);
      }
    }
  }
  return 0;
}
