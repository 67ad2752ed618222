/* The C API of a `flowgen build --lib` library whose input 0 has a dynamic first dimension
 * (tests/test_dynamic_deploy.py builds it with AddressSanitizer and UndefinedBehaviorSanitizer
 * and runs this against it).
 *
 *   embed_dynamic_checks
 *
 * The model has one float32 input [batch, features] and one output [batch, outputs]. Prints
 * the signature ("input: ..." and "output: ..." lines with -1 for a dynamic dimension), one line
 * per refused call ("<check>: rc <code>: <message>"), the output at every batch from the minimum
 * to the maximum ("batch <n>: <v> <v> ..."), and "threads: <n> calls agree" when every call of
 * threads each at its own batch returned what that batch gives alone. Exits 1 when a call that
 * must fail succeeds, or one that must succeed fails. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include FLOWGEN_MODEL_HEADER
#include "embed_threads.h"

#define THREADS 4
#define CALLS 20

static flowgen_model* model;
static flowgen_tensor_info in_info, out_info;
static int failures = 0;
static float** expected; /* per batch: the output of fill(x, batch) */

static void expect_error(const char* check, int rc) {
  printf("%s: rc %d: %s\n", check, rc, flowgen_last_error());
  if (rc == FLOWGEN_OK) {
    printf("  ^ should have failed\n");
    failures++;
  }
}

static size_t features(void) { return (size_t)in_info.shape[1]; }
static size_t outputs(void) { return (size_t)out_info.shape[1]; }

static void fill(float* x, long long batch) {
  for (size_t k = 0; k < (size_t)batch * features(); ++k) x[k] = (float)((k * 7 + (size_t)batch * 3) % 13) / 6.0f - 1.0f;
}

static flowgen_tensor input_of(float* x, long long batch) {
  flowgen_tensor t;
  memset(&t, 0, sizeof t);
  t.data = x;
  t.dtype = in_info.dtype;
  t.ndim = 2;
  t.shape[0] = batch;
  t.shape[1] = in_info.shape[1];
  t.memory = FLOWGEN_HOST;
  return t;
}

static void print_info(const char* role, const flowgen_tensor_info* info) {
  printf("%s: %s ndim %d", role, info->name, info->ndim);
  for (int d = 0; d < info->ndim; ++d)
    printf(" [%lld %lld..%lld]", (long long)info->shape[d], (long long)info->min_shape[d], (long long)info->max_shape[d]);
  printf("\n");
}

static void* worker(void* arg) {
  const long long batch = in_info.min_shape[0] + (long long)(size_t)arg * 3 % (in_info.max_shape[0] - in_info.min_shape[0] + 1);
  float* x = malloc((size_t)batch * features() * sizeof(float));
  fill(x, batch);
  size_t bad = 0;
  for (int c = 0; c < CALLS; ++c) {
    flowgen_tensor in = input_of(x, batch), out;
    memset(&out, 0, sizeof out);
    if (flowgen_run(model, &in, 1, &out, 1) != FLOWGEN_OK || out.shape[0] != batch ||
        memcmp(out.data, expected[batch], (size_t)batch * outputs() * sizeof(float)) != 0)
      bad++;
  }
  free(x);
  return (void*)bad;
}

int main(void) {
  model = flowgen_create(NULL);
  if (!model) {
    printf("create: %s\n", flowgen_last_error());
    return 1;
  }
  if (flowgen_input_info(0, &in_info) || flowgen_output_info(0, &out_info)) return 1;
  print_info("input", &in_info);
  print_info("output", &out_info);
  const long long lo = in_info.min_shape[0], hi = in_info.max_shape[0];

  float* x = malloc((size_t)(hi + 1) * features() * sizeof(float));
  fill(x, hi);
  flowgen_tensor in, out;
  memset(&out, 0, sizeof out);
  const long long bad_batches[] = {0, lo - 1, hi + 1, -3, 1LL << 40};
  for (size_t b = 0; b < sizeof bad_batches / sizeof bad_batches[0]; ++b) {
    if (bad_batches[b] >= lo && bad_batches[b] <= hi) continue;
    char check[64];
    snprintf(check, sizeof check, "run batch %lld", bad_batches[b]);
    in = input_of(x, bad_batches[b]);
    expect_error(check, flowgen_run(model, &in, 1, &out, 1));
  }
  in = input_of(x, lo);
  in.shape[1] += 1;
  expect_error("run features + 1", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(x, lo);
  in.ndim = 1;
  expect_error("run ndim 1", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(NULL, lo);
  expect_error("run NULL data", flowgen_run(model, &in, 1, &out, 1));

  expected = calloc((size_t)hi + 1, sizeof(float*));
  for (long long batch = lo; batch <= hi; ++batch) {
    fill(x, batch);
    in = input_of(x, batch);
    if (flowgen_run(model, &in, 1, &out, 1) != FLOWGEN_OK || out.ndim != 2 || out.shape[0] != batch ||
        out.shape[1] != out_info.shape[1]) {
      printf("run batch %lld: %s\n", batch, flowgen_last_error());
      return 1;
    }
    expected[batch] = malloc((size_t)batch * outputs() * sizeof(float));
    memcpy(expected[batch], out.data, (size_t)batch * outputs() * sizeof(float));
    printf("batch %lld:", batch);
    for (size_t k = 0; k < (size_t)batch * outputs(); ++k) printf(" %.9g", (double)expected[batch][k]);
    printf("\n");
  }

  const size_t bad = run_workers(worker, THREADS);
  if (bad == 0) printf("threads: %d calls agree\n", THREADS * CALLS);
  for (long long batch = lo; batch <= hi; ++batch) free(expected[batch]);
  free(expected);
  free(x);
  flowgen_destroy(model);
  return failures || bad ? 1 : 0;
}
