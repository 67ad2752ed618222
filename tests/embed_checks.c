/* The C API of a `flowgen build --lib` library against bad arguments and files, and from several
 * threads at once (tests/test_embed_library.py builds it with AddressSanitizer and
 * UndefinedBehaviorSanitizer, and with ThreadSanitizer, and runs it).
 *
 *   embed_checks GOOD_WEIGHTS [BAD_WEIGHTS...]
 *
 * The model has one float32 input. Prints one line per check ("<check>: rc <code>: <message>"),
 * then the output of input pattern 0 ("value <v>" lines) and "threads: <n> calls agree" when
 * every call of every thread returned the output its input gives alone. Exits 1 when a check
 * that must fail succeeds (or the reverse). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include FLOWGEN_MODEL_HEADER
#include "embed_threads.h"

#define THREADS 4
#define CALLS 25

static flowgen_model* model;
static flowgen_tensor_info in_info, out_info;
static size_t in_count = 1, out_count = 1;
static int failures = 0;

static void expect_error(const char* check, int rc) {
  printf("%s: rc %d: %s\n", check, rc, flowgen_last_error());
  if (rc == FLOWGEN_OK) {
    printf("  ^ should have failed\n");
    failures++;
  }
}

static void fill(float* x, int pattern) {
  for (size_t k = 0; k < in_count; ++k) x[k] = (float)((k * 7 + (size_t)pattern * 3) % 11) / 5.0f - 1.0f;
}

static flowgen_tensor input_of(float* x) {
  flowgen_tensor t;
  memset(&t, 0, sizeof t);
  t.data = x;
  t.dtype = in_info.dtype;
  t.ndim = in_info.ndim;
  for (int d = 0; d < in_info.ndim; ++d) t.shape[d] = in_info.shape[d];
  t.memory = FLOWGEN_HOST;
  return t;
}

static float* expected[THREADS];

static void* worker(void* arg) {
  const int pattern = (int)(size_t)arg;
  float* x = malloc(in_count * sizeof(float));
  fill(x, pattern);
  size_t bad = 0;
  for (int c = 0; c < CALLS; ++c) {
    flowgen_tensor in = input_of(x), out;
    memset(&out, 0, sizeof out);
    if (flowgen_run(model, &in, 1, &out, 1) != FLOWGEN_OK || memcmp(out.data, expected[pattern], out_count * 4) != 0)
      bad++;
  }
  free(x);
  return (void*)bad;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  for (int i = 2; i < argc; ++i) {
    flowgen_model* m = flowgen_create(argv[i]);
    char check[64];
    snprintf(check, sizeof check, "create bad weights %d", i - 1);
    expect_error(check, m ? FLOWGEN_OK : flowgen_last_error_code());
    flowgen_destroy(m);
  }
  expect_error("create empty path", flowgen_create("") ? FLOWGEN_OK : flowgen_last_error_code());
  model = flowgen_create(argv[1]);
  if (!model) {
    printf("create: %s\n", flowgen_last_error());
    return 1;
  }
  expect_error("input_info -1", flowgen_input_info(-1, &in_info));
  expect_error("output_info 99", flowgen_output_info(99, &out_info));
  expect_error("input_info NULL", flowgen_input_info(0, NULL));
  if (flowgen_input_info(0, &in_info) || flowgen_output_info(0, &out_info)) return 1;
  for (int d = 0; d < in_info.ndim; ++d) in_count *= (size_t)in_info.shape[d];
  for (int d = 0; d < out_info.ndim; ++d) out_count *= (size_t)out_info.shape[d];

  float* x = malloc(in_count * sizeof(float));
  fill(x, 0);
  flowgen_tensor in = input_of(x), out;
  memset(&out, 0, sizeof out);
  expect_error("run NULL model", flowgen_run(NULL, &in, 1, &out, 1));
  expect_error("run NULL inputs", flowgen_run(model, NULL, 1, &out, 1));
  expect_error("run NULL outputs", flowgen_run(model, &in, 1, NULL, 1));
  expect_error("run n_inputs 2", flowgen_run(model, &in, 2, &out, 1));
  expect_error("run n_inputs -1", flowgen_run(model, &in, -1, &out, 1));
  expect_error("run n_outputs 0", flowgen_run(model, &in, 1, &out, 0));
  in.dtype = 99;
  expect_error("run dtype 99", flowgen_run(model, &in, 1, &out, 1));
  in.dtype = FLOWGEN_FLOAT64;
  expect_error("run dtype float64", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(x);
  in.ndim = 9;
  expect_error("run ndim 9", flowgen_run(model, &in, 1, &out, 1));
  in.ndim = -1;
  expect_error("run ndim -1", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(x);
  in.shape[0] += 1;
  expect_error("run bad shape", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(x);
  in.data = NULL;
  expect_error("run NULL data", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(x);
  in.memory = 7;
  expect_error("run memory 7", flowgen_run(model, &in, 1, &out, 1));
  in.memory = FLOWGEN_CUDA_DEVICE;
  expect_error("run device memory", flowgen_run(model, &in, 1, &out, 1));
  in = input_of(x);
  out.memory = -3;
  expect_error("run output memory -3", flowgen_run(model, &in, 1, &out, 1));
  out.memory = FLOWGEN_HOST;

  for (int p = 0; p < THREADS; ++p) {  /* each pattern alone, one thread */
    fill(x, p);
    in = input_of(x);
    if (flowgen_run(model, &in, 1, &out, 1) != FLOWGEN_OK) {
      printf("run: %s\n", flowgen_last_error());
      return 1;
    }
    expected[p] = malloc(out_count * sizeof(float));
    memcpy(expected[p], out.data, out_count * sizeof(float));
  }
  for (size_t k = 0; k < out_count; ++k) printf("value %.9g\n", (double)expected[0][k]);

  const size_t bad = run_workers(worker, THREADS);
  if (bad == 0) printf("threads: %d calls agree\n", THREADS * CALLS);
  else printf("threads: %zu of %d calls differ\n", bad, THREADS * CALLS);

  for (int p = 0; p < THREADS; ++p) free(expected[p]);
  free(x);
  flowgen_destroy(model);
  flowgen_destroy(NULL);
  return failures || bad ? 1 : 0;
}
