/* Embedding a flowgen model in a C program: examples/embed/main.c.
 *
 * Build a model as a library (README.md, "Embedding a model"), then compile this file
 * against it, with the header's name given as FLOWGEN_MODEL_HEADER:
 *
 *   flowgen build SAVED_DIR -o out --target cpu --lib [--name NAME]   # <name>: NAME, or the graph's name
 *   cc -std=c99 -O2 examples/embed/main.c -Iout -DFLOWGEN_MODEL_HEADER='"<name>.h"' \
 *      -Lout -l<name> -Wl,-rpath,"$PWD/out" -o embed_demo
 *   ./embed_demo [WEIGHTS.safetensors]
 *
 * It prints the model's signature, fills every input with a fixed pattern (element k of input i
 * is sin(0.37 k + i)), runs the model once and prints every output element. Float32 inputs only
 * (the pattern is a float); other dtypes are refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include FLOWGEN_MODEL_HEADER

static void print_info(const char* role, const flowgen_tensor_info* info) {
  printf("%s %s: dtype %d shape [", role, info->name, info->dtype);
  for (int d = 0; d < info->ndim; ++d) printf(d ? ", %lld" : "%lld", (long long)info->shape[d]);
  printf("]\n");
}

int main(int argc, char** argv) {
  if (flowgen_api_version() != FLOWGEN_API_VERSION) {
    fprintf(stderr, "the library's C API is version %d, this program's header %d\n", flowgen_api_version(),
            FLOWGEN_API_VERSION);
    return 1;
  }
  flowgen_model* model = flowgen_create(argc > 1 ? argv[1] : NULL);
  if (!model) {
    fprintf(stderr, "flowgen_create: %s\n", flowgen_last_error());
    return 1;
  }
  const int n_inputs = flowgen_num_inputs(), n_outputs = flowgen_num_outputs();
  flowgen_tensor* inputs = calloc((size_t)n_inputs + 1, sizeof(flowgen_tensor));
  flowgen_tensor* outputs = calloc((size_t)n_outputs + 1, sizeof(flowgen_tensor));  /* memory: FLOWGEN_HOST */
  float** buffers = calloc((size_t)n_inputs + 1, sizeof(float*));
  int status = 1;
  for (int i = 0; i < n_inputs; ++i) {
    flowgen_tensor_info info;
    flowgen_input_info(i, &info);
    print_info("input", &info);
    if (info.dtype != FLOWGEN_FLOAT32) {
      fprintf(stderr, "input %s is not float32; this example fills float32 inputs only\n", info.name);
      goto done;
    }
    size_t count = 1;
    for (int d = 0; d < info.ndim; ++d) count *= (size_t)info.shape[d];
    buffers[i] = malloc(count * sizeof(float) + 1);
    for (size_t k = 0; k < count; ++k) buffers[i][k] = (float)sin(0.37 * (double)k + i);
    inputs[i].data = buffers[i];
    inputs[i].dtype = info.dtype;
    inputs[i].ndim = info.ndim;
    for (int d = 0; d < info.ndim; ++d) inputs[i].shape[d] = info.shape[d];
    inputs[i].memory = FLOWGEN_HOST;
  }
  if (flowgen_run(model, inputs, n_inputs, outputs, n_outputs) != FLOWGEN_OK) {
    fprintf(stderr, "flowgen_run: %s\n", flowgen_last_error());
    goto done;
  }
  for (int i = 0; i < n_outputs; ++i) {
    flowgen_tensor_info info;
    flowgen_output_info(i, &info);
    print_info("output", &info);
    size_t count = 1;
    for (int d = 0; d < outputs[i].ndim; ++d) count *= (size_t)outputs[i].shape[d];
    if (outputs[i].dtype != FLOWGEN_FLOAT32) {
      printf("  (%zu elements of dtype %d)\n", count, outputs[i].dtype);
      continue;
    }
    const float* values = outputs[i].data;  /* owned by the model until this thread's next run */
    for (size_t k = 0; k < count; ++k) printf("%.9g\n", values[k]);
  }
  status = 0;
done:
  for (int i = 0; i < n_inputs; ++i) free(buffers[i]);
  free(buffers);
  free(inputs);
  free(outputs);
  flowgen_destroy(model);
  return status;
}
