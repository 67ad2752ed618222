/* examples/generate/run.c: text generation without Python, in the manner of llama2.c's run.c.
 *
 * The model is examples/gpt_char.py's GPT built by examples/generate/build.py as two shared
 * libraries with flowgen's C API, each with a dynamic dimension (any size in its range, each
 * call's work following it):
 *   BUILD_DIR/prefill/libgpt_prefill.so  the prompt's tokens, all in one call -> the next token's
 *                                        logits and the K/V caches of the prompt's positions
 *   BUILD_DIR/decode/libgpt_decode.so    one token, its position and the caches so far -> the
 *                                        next token's logits and the caches one position longer
 * (two, because a dynamic dimension's smallest size is 1: the decoding step cannot start from
 * empty caches). This program runs the prefill on the prompt, then the step on each token it
 * picks: the argmax (greedy, -t 0) or a draw from the top-k logits at a temperature, with its own
 * seeded random numbers (the same seed, the same tokens). It copies the caches each call returns
 * (the model's memory until its next run) into its own, which grow by one position a step.
 *
 * Every flowgen library exports the same C API names, so the two are not linked: each is opened
 * with dlopen(RTLD_LOCAL), which keeps its symbols apart, and its functions found with dlsym.
 * The decode build's header gives the API's types (both builds' headers declare the same ones).
 *
 *   python examples/generate/build.py --out gen      # prints the compile command, e.g.
 *   cc -std=c99 -O2 examples/generate/run.c -Igen/decode -o gen/run -ldl -lm
 *   ./gen/run gen -p "A graph is" -n 40 -t 0.8 -k 10 -s 7
 *
 * Options:
 *   -p TEXT   the prompt as text (needs BUILD_DIR/vocab.txt: the characters in token-id order)
 *   -i IDS    the prompt as token ids, comma separated (default: the token 0)
 *   -n N      tokens to generate (default 32); generation stops early at the model's capacity
 *   -t T      temperature (default 0: greedy, the argmax)
 *   -k K      sample from the K most likely tokens only (default 0: all of them)
 *   -s SEED   the sampler's seed (default 1)
 *   -r        print the token ids (prompt and generated), one line, instead of the text
 * Tokens per second go to stderr: the tokens generated over the time of the calls that generated
 * them (the prefill, which gives the first, then one decoding step for each of the others), with
 * the prefill's own time beside.
 *
 * A sequence is at most the model's block size long (the position embedding's rows): the
 * prefill takes a prompt of up to that many tokens and the step caches of up to one fewer.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpt_decode.h"   /* the C API's types; its functions come from dlsym */

static int fail(const char* what, const char* why) {
  fprintf(stderr, "run: %s: %s\n", what, why);
  return 1;
}

/* ---------------------------------------------------------------------------------- a library */
/* One of the two libraries, opened with dlopen: its C API and a model of its weights. */
typedef struct {
  char path[4096];   /* the .so, for messages */
  void* handle;
  int (*api_version)(void);
  int (*num_inputs)(void);
  int (*num_outputs)(void);
  int (*input_info)(int, flowgen_tensor_info*);
  int (*output_info)(int, flowgen_tensor_info*);
  flowgen_model* (*create)(const char*);
  int (*run)(flowgen_model*, const flowgen_tensor*, int, flowgen_tensor*, int);
  const char* (*last_error)(void);
  void (*destroy)(flowgen_model*);
  flowgen_model* model;
  int n_inputs, n_outputs;
  flowgen_tensor* inputs;
  flowgen_tensor* outputs;   /* the model's memory until its next run */
} Library;

/* dlsym's object pointer as a function pointer (POSIX guarantees the conversion). */
#define FIND(lib, field, symbol)                                            \
  do {                                                                      \
    void* address = dlsym((lib)->handle, symbol);                           \
    if (!address) {                                                         \
      fprintf(stderr, "run: %s has no %s: not a flowgen --lib build\n", (lib)->path, symbol); \
      return 1;                                                             \
    }                                                                       \
    memcpy(&(lib)->field, &address, sizeof address);                       \
  } while (0)

/* Open BUILD_DIR/PART/libNAME.so (RTLD_LOCAL: its symbols stay its own) and find its C API. */
static int library_open(Library* lib, const char* build_dir, const char* part, const char* name) {
  snprintf(lib->path, sizeof lib->path, "%s/%s/lib%s.so", build_dir, part, name);
  lib->handle = dlopen(lib->path, RTLD_NOW | RTLD_LOCAL);
  if (!lib->handle) {
    fprintf(stderr, "run: cannot open the %s library: %s (examples/generate/build.py --out %s builds it)\n", part,
            dlerror(), build_dir);
    return 1;
  }
  FIND(lib, api_version, "flowgen_api_version");
  FIND(lib, num_inputs, "flowgen_num_inputs");
  FIND(lib, num_outputs, "flowgen_num_outputs");
  FIND(lib, input_info, "flowgen_input_info");
  FIND(lib, output_info, "flowgen_output_info");
  FIND(lib, create, "flowgen_create");
  FIND(lib, run, "flowgen_run");
  FIND(lib, last_error, "flowgen_last_error");
  FIND(lib, destroy, "flowgen_destroy");
  if (lib->api_version() != FLOWGEN_API_VERSION) {
    fprintf(stderr, "run: %s has C API version %d; this program was compiled for version %d\n", lib->path,
            lib->api_version(), FLOWGEN_API_VERSION);
    return 1;
  }
  lib->n_inputs = lib->num_inputs();
  lib->n_outputs = lib->num_outputs();
  return 0;
}

/* Load the weights (BUILD_DIR/PART/weights.safetensors) and make the argument arrays. */
static int library_create(Library* lib, const char* build_dir, const char* part) {
  char weights[4096];
  snprintf(weights, sizeof weights, "%s/%s/weights.safetensors", build_dir, part);
  lib->model = lib->create(weights);
  if (!lib->model) {
    fprintf(stderr, "run: %s: flowgen_create: %s\n", lib->path, lib->last_error());
    return 1;
  }
  lib->inputs = calloc((size_t)lib->n_inputs, sizeof(flowgen_tensor));
  lib->outputs = calloc((size_t)lib->n_outputs, sizeof(flowgen_tensor));
  if (!lib->inputs || !lib->outputs) return fail("run", "out of memory");
  return 0;
}

static int library_run(Library* lib) {
  if (lib->run(lib->model, lib->inputs, lib->n_inputs, lib->outputs, lib->n_outputs) == FLOWGEN_OK) return 0;
  fprintf(stderr, "run: %s: flowgen_run: %s\n", lib->path, lib->last_error());
  return 1;
}

static void library_close(Library* lib) {
  free(lib->inputs);
  free(lib->outputs);
  if (lib->model) lib->destroy(lib->model);
  if (lib->handle) dlclose(lib->handle);
}

/* ---------------------------------------------------------------------------------- the signatures */
/* A tensor's expected dtype and shape: per axis, a size (> 0), ANY (some fixed size) or
 * DYNAMIC (-1 in the signature: the library's dynamic dimension). */
enum { ANY = 0, DYNAMIC = -1 };

static void print_shape(const int64_t* shape, int ndim) {
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == DYNAMIC) fprintf(stderr, "%s?", d ? ", " : "");
    else fprintf(stderr, "%s%lld", d ? ", " : "", (long long)shape[d]);
  }
}

/* Whether `info` is `dtype` [`want`...]; else the difference printed, naming the library, the
 * tensor and `meaning` (the expected shape in words). */
static int expect(const Library* lib, const char* kind, int index, const flowgen_tensor_info* info, int dtype,
                  int ndim, const int64_t* want, const char* meaning) {
  int ok = info->dtype == dtype && info->ndim == ndim;
  for (int d = 0; ok && d < ndim; ++d)
    ok = want[d] == ANY ? info->shape[d] > 0 : info->shape[d] == want[d];
  if (ok) return 0;
  static const char* const names[] = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "bool"};
  const char* got = info->dtype >= 0 && info->dtype <= FLOWGEN_BOOL ? names[info->dtype] : "an unknown dtype";
  const int rank = info->ndim < 0 ? 0 : info->ndim > FLOWGEN_MAX_DIMS ? FLOWGEN_MAX_DIMS : info->ndim;
  fprintf(stderr, "run: %s: %s %d (%s) is %s [", lib->path, kind, index, info->name, got);
  print_shape(info->shape, rank);
  int dynamic = 0;
  for (int d = 0; d < rank; ++d) dynamic |= info->shape[d] == DYNAMIC;
  fprintf(stderr, "]%s, expected %s %s: not the library examples/generate/build.py builds\n",
          dynamic ? " (? dynamic)" : "", dtype == FLOWGEN_INT64 ? "int64" : "float32", meaning);
  return 1;
}

/* ---------------------------------------------------------------------------------- the decoder */
/* The signatures (build.py; ? a dynamic dimension):
 *   prefill: input 0 the prompt, int64 [1, ?seq]; output 0 the last position's logits, float32
 *            [1, vocab_size]; then the caches, float32 [1, n_head, ?seq, head_dim] (k_0, v_0, ...).
 *   decode:  input 0 the token, int64 [1, 1]; input 1 its position, int64 [1]; then the caches,
 *            float32 [1, n_head, ?past, head_dim]; output 0 the logits, float32 [1, vocab_size];
 *            then the caches, [1, n_head, ?past + 1, head_dim], in the inputs' order. */
typedef struct {
  Library prefill, decode;
  int n_caches;
  int vocab_size;
  int capacity;              /* the longest sequence: the prefill's longest prompt */
  int64_t n_head, head_dim;
  size_t position_floats;    /* one position of one cache: n_head * head_dim floats */
  float** caches;            /* ours: the caches the next step reads, room for `capacity` positions */
  int length;                /* the positions they hold */
  int64_t* tokens;           /* the prefill's input (capacity tokens) */
  int64_t token, pos;        /* the step's inputs */
} Decoder;

/* The two libraries' signatures checked against each other and the layout above. */
static int check_signatures(Decoder* d) {
  Library *p = &d->prefill, *s = &d->decode;
  if (p->n_inputs != 1 || p->n_outputs < 3 || (p->n_outputs - 1) % 2 != 0) {
    fprintf(stderr, "run: %s takes %d inputs and gives %d outputs; the prefill takes the prompt and gives the "
            "logits and 2 caches per layer\n", p->path, p->n_inputs, p->n_outputs);
    return 1;
  }
  d->n_caches = p->n_outputs - 1;
  if (s->n_inputs != 2 + d->n_caches || s->n_outputs != 1 + d->n_caches) {
    fprintf(stderr, "run: %s takes %d inputs and gives %d outputs; the decoding step of the prefill's %d caches "
            "takes a token, its position and the caches (%d inputs) and gives the logits and the caches (%d)\n",
            s->path, s->n_inputs, s->n_outputs, d->n_caches, 2 + d->n_caches, 1 + d->n_caches);
    return 1;
  }
  flowgen_tensor_info info, first;
  p->input_info(0, &info);
  if (expect(p, "input", 0, &info, FLOWGEN_INT64, 2, (int64_t[]){1, DYNAMIC}, "[1, seq] (the prompt)")) return 1;
  if (info.min_shape[1] != 1) {
    fprintf(stderr, "run: %s: the prompt's length is %lld to %lld; expected from 1\n", p->path,
            (long long)info.min_shape[1], (long long)info.max_shape[1]);
    return 1;
  }
  d->capacity = (int)info.max_shape[1];
  p->output_info(0, &info);
  if (expect(p, "output", 0, &info, FLOWGEN_FLOAT32, 2, (int64_t[]){1, ANY}, "[1, vocab] (the logits)")) return 1;
  d->vocab_size = (int)info.shape[1];
  p->output_info(1, &first);
  if (expect(p, "output", 1, &first, FLOWGEN_FLOAT32, 4, (int64_t[]){1, ANY, DYNAMIC, ANY},
             "[1, heads, seq, head_dim] (a cache)"))
    return 1;
  d->n_head = first.shape[1];
  d->head_dim = first.shape[3];
  const int64_t* cache = (int64_t[]){1, d->n_head, DYNAMIC, d->head_dim};
  const char* cache_words = "[1, heads, ?, head_dim] (a cache, as the prefill's)";
  for (int c = 0; c < d->n_caches; ++c) {
    p->output_info(1 + c, &info);
    if (expect(p, "output", 1 + c, &info, FLOWGEN_FLOAT32, 4, cache, cache_words)) return 1;
    if (info.max_shape[2] != d->capacity) {
      fprintf(stderr, "run: %s: output %d holds up to %lld positions, the prompt %d\n", p->path, 1 + c,
              (long long)info.max_shape[2], d->capacity);
      return 1;
    }
  }
  s->input_info(0, &info);
  if (expect(s, "input", 0, &info, FLOWGEN_INT64, 2, (int64_t[]){1, 1}, "[1, 1] (the token)")) return 1;
  s->input_info(1, &info);
  if (expect(s, "input", 1, &info, FLOWGEN_INT64, 1, (int64_t[]){1}, "[1] (its position)")) return 1;
  s->output_info(0, &info);
  if (expect(s, "output", 0, &info, FLOWGEN_FLOAT32, 2, (int64_t[]){1, d->vocab_size},
             "[1, vocab] (the logits, as the prefill's)"))
    return 1;
  for (int c = 0; c < d->n_caches; ++c) {
    s->input_info(2 + c, &info);
    if (expect(s, "input", 2 + c, &info, FLOWGEN_FLOAT32, 4, cache, cache_words)) return 1;
    if (info.min_shape[2] != 1 || info.max_shape[2] != d->capacity - 1) {
      fprintf(stderr, "run: %s: input %d holds %lld to %lld positions; expected 1 to %d, one fewer than the "
              "prefill's longest prompt\n", s->path, 2 + c, (long long)info.min_shape[2],
              (long long)info.max_shape[2], d->capacity - 1);
      return 1;
    }
    s->output_info(1 + c, &info);
    if (expect(s, "output", 1 + c, &info, FLOWGEN_FLOAT32, 4, cache, cache_words)) return 1;
  }
  return 0;
}

static int decoder_open(Decoder* d, const char* build_dir) {
  memset(d, 0, sizeof *d);
  if (library_open(&d->prefill, build_dir, "prefill", "gpt_prefill") ||
      library_open(&d->decode, build_dir, "decode", "gpt_decode") || check_signatures(d) ||
      library_create(&d->prefill, build_dir, "prefill") || library_create(&d->decode, build_dir, "decode"))
    return 1;
  d->position_floats = (size_t)d->n_head * (size_t)d->head_dim;
  d->caches = calloc((size_t)d->n_caches, sizeof(float*));
  d->tokens = calloc((size_t)d->capacity, sizeof(int64_t));
  if (!d->caches || !d->tokens) return fail("run", "out of memory");
  for (int c = 0; c < d->n_caches; ++c) {
    d->caches[c] = malloc(sizeof(float) * d->position_floats * (size_t)d->capacity);
    if (!d->caches[c]) return fail("run", "out of memory");
  }
  d->decode.inputs[0] = (flowgen_tensor){&d->token, FLOWGEN_INT64, 2, {1, 1}, FLOWGEN_HOST};
  d->decode.inputs[1] = (flowgen_tensor){&d->pos, FLOWGEN_INT64, 1, {1}, FLOWGEN_HOST};
  for (int c = 0; c < d->n_caches; ++c)
    d->decode.inputs[2 + c] = (flowgen_tensor){d->caches[c], FLOWGEN_FLOAT32, 4, {1, d->n_head, 0, d->head_dim},
                                               FLOWGEN_HOST};
  return 0;
}

/* The caches a call returned (`outputs` 1...), `length` positions each, copied into ours: they
 * belong to the model until its next run, which reads ours. */
static int keep_caches(Decoder* d, const Library* lib, int length) {
  for (int c = 0; c < d->n_caches; ++c) {
    const flowgen_tensor* out = &lib->outputs[1 + c];
    if (out->ndim != 4 || out->shape[2] != length) {
      fprintf(stderr, "run: %s: output %d has %lld positions, expected %d\n", lib->path, 1 + c,
              (long long)(out->ndim == 4 ? out->shape[2] : -1), length);
      return 1;
    }
    memcpy(d->caches[c], out->data, sizeof(float) * d->position_floats * (size_t)length);
  }
  d->length = length;
  return 0;
}

/* The prompt (`n` tokens, 1 <= n <= capacity) in one call; the logits of the token after it (the
 * model's memory until its next run), or NULL with the reason printed. */
static const float* decoder_prefill(Decoder* d, const int* ids, int n) {
  for (int i = 0; i < n; ++i) d->tokens[i] = ids[i];
  d->prefill.inputs[0] = (flowgen_tensor){d->tokens, FLOWGEN_INT64, 2, {1, n}, FLOWGEN_HOST};
  if (library_run(&d->prefill) || keep_caches(d, &d->prefill, n)) return NULL;
  return d->prefill.outputs[0].data;
}

/* The step on `token` at the position after the caches (1 <= length < capacity); the logits of
 * the token after it, or NULL with the reason printed. */
static const float* decoder_step(Decoder* d, int token) {
  d->token = token;
  d->pos = d->length;
  for (int c = 0; c < d->n_caches; ++c) d->decode.inputs[2 + c].shape[2] = d->length;
  if (library_run(&d->decode) || keep_caches(d, &d->decode, d->length + 1)) return NULL;
  return d->decode.outputs[0].data;
}

static void decoder_close(Decoder* d) {
  if (d->caches)
    for (int c = 0; c < d->n_caches; ++c) free(d->caches[c]);
  free(d->caches);
  free(d->tokens);
  library_close(&d->prefill);
  library_close(&d->decode);
}

/* ---------------------------------------------------------------------------------- the sampler */
/* xorshift64*, as llama2.c's: a fixed seed gives the same numbers on every machine. */
static uint32_t random_u32(uint64_t* state) {
  *state ^= *state >> 12;
  *state ^= *state << 25;
  *state ^= *state >> 27;
  return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

static double random_unit(uint64_t* state) { return (random_u32(state) >> 8) / 16777216.0; } /* [0, 1) */

static int argmax(const float* logits, int n) {
  int best = 0;   /* the first of equal maxima, as NumPy's argmax */
  for (int i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

/* A token drawn from softmax(logits / temperature) over the `top_k` most likely (0: all);
 * `order` is scratch space for n ids. */
static int sample(const float* logits, int n, int top_k, float temperature, int* order, uint64_t* rng) {
  const int k = top_k > 0 && top_k < n ? top_k : n;
  for (int i = 0; i < n; ++i) order[i] = i;
  for (int i = 0; i < k; ++i) {   /* the k largest to the front, largest first (ties: the lower id) */
    int best = i;
    for (int j = i + 1; j < n; ++j)
      if (logits[order[j]] > logits[order[best]]) best = j;
    const int swap = order[i];
    order[i] = order[best];
    order[best] = swap;
  }
  double total = 0.0;
  for (int i = 0; i < k; ++i) total += exp((logits[order[i]] - logits[order[0]]) / temperature);
  double r = random_unit(rng) * total;
  for (int i = 0; i < k; ++i) {
    r -= exp((logits[order[i]] - logits[order[0]]) / temperature);
    if (r < 0.0) return order[i];
  }
  return order[k - 1];   /* r within rounding of the total */
}

/* ------------------------------------------------------------------------------- the vocabulary */
/* BUILD_DIR/vocab.txt: character i is token i. Its length, or 0 when there is no such file. */
static int read_vocab(const char* build_dir, char* vocab, int size) {
  char path[4096];
  snprintf(path, sizeof path, "%s/vocab.txt", build_dir);
  FILE* f = fopen(path, "rb");
  if (!f) return 0;
  const int n = (int)fread(vocab, 1, (size_t)size, f);
  fclose(f);
  return n;
}

/* The prompt's token ids into `ids` (at most `capacity`); their count, or -1 with the reason printed. */
static int parse_ids(const char* text, int* ids, int capacity, int vocab_size) {
  int n = 0;
  for (const char* p = text; *p;) {
    char* end;
    const long id = strtol(p, &end, 10);
    if (end == p || (*end && *end != ',')) {
      fprintf(stderr, "run: -i %s: expected token ids separated by commas, at \"%s\"\n", text, p);
      return -1;
    }
    if (id < 0 || id >= vocab_size) {
      fprintf(stderr, "run: -i: token id %ld (prompt position %d) is outside the vocabulary: 0 to %d\n", id, n,
              vocab_size - 1);
      return -1;
    }
    if (n == capacity) {
      fprintf(stderr, "run: the prompt has more than %d tokens; the model's KV cache holds %d positions (its "
              "block size)\n", capacity, capacity);
      return -1;
    }
    ids[n++] = (int)id;
    p = *end ? end + 1 : end;
  }
  return n;
}

static int encode_text(const char* text, const char* vocab, int vocab_length, int* ids, int capacity) {
  const int n = (int)strlen(text);
  if (n > capacity) {
    fprintf(stderr, "run: the prompt has %d characters; the model's KV cache holds %d positions (its block "
            "size)\n", n, capacity);
    return -1;
  }
  for (int i = 0; i < n; ++i) {
    const char* found = memchr(vocab, text[i], (size_t)vocab_length);
    if (!found) {
      fprintf(stderr, "run: the prompt's character %d ('%c') is not in the vocabulary\n", i, text[i]);
      return -1;
    }
    ids[i] = (int)(found - vocab);
  }
  return n;
}

/* ---------------------------------------------------------------------------------------- main */
static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* An option's value as a number; non-zero with the reason printed when it is not one (or, with
 * `whole`, not a whole number). */
static int parse_number(char flag, const char* value, int whole, double* number) {
  char* end;
  *number = strtod(value, &end);
  if (end == value || *end || !isfinite(*number) || (whole && (*number != floor(*number) || fabs(*number) > 1e9))) {
    fprintf(stderr, "run: -%c %s: expected %s\n", flag, value, whole ? "a whole number" : "a number");
    return 1;
  }
  return 0;
}

static int usage(void) {
  fprintf(stderr, "usage: run BUILD_DIR [-p TEXT | -i IDS] [-n N] [-t TEMPERATURE] [-k TOP_K] [-s SEED] [-r]\n"
          "  BUILD_DIR: examples/generate/build.py's --out (prefill/, decode/, vocab.txt)\n"
          "  (examples/generate/run.c's header says what each option does)\n");
  return 2;
}

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return usage();
  const char* build_dir = argv[1];
  const char *prompt_text = NULL, *prompt_ids = "0";
  int steps = 32, top_k = 0, raw = 0;
  float temperature = 0.0f;
  unsigned long long seed = 1;
  for (int i = 2; i < argc; ++i) {
    const char* flag = argv[i];
    if (strcmp(flag, "-r") == 0) {
      raw = 1;
      continue;
    }
    if (flag[0] != '-' || strlen(flag) != 2 || i + 1 == argc) return usage();
    if (!strchr("pintks", flag[1])) return usage();
    const char* value = argv[++i];
    double number = 0.0;
    if (flag[1] != 'p' && flag[1] != 'i') {
      if (parse_number(flag[1], value, flag[1] != 't', &number)) return 1;
      if (number < 0.0) return fail("options", "-n, -t, -k and -s must not be negative");
    }
    switch (flag[1]) {
      case 'p': prompt_text = value; break;
      case 'i': prompt_ids = value; break;
      case 'n': steps = (int)number; break;
      case 't': temperature = (float)number; break;
      case 'k': top_k = (int)number; break;
      case 's': seed = (unsigned long long)number; break;
      default: return usage();
    }
  }

  Decoder decoder;
  int status = 1;
  int* ids = NULL;
  int* order = NULL;
  if (decoder_open(&decoder, build_dir) != 0) goto done;
  char vocab[4096];
  const int vocab_length = read_vocab(build_dir, vocab, (int)sizeof vocab);
  if (vocab_length && vocab_length != decoder.vocab_size) {
    fprintf(stderr, "run: %s/vocab.txt has %d characters, the model %d tokens\n", build_dir, vocab_length,
            decoder.vocab_size);
    goto done;
  }
  ids = malloc(sizeof(int) * (size_t)decoder.capacity);
  order = malloc(sizeof(int) * (size_t)decoder.vocab_size);
  if (!ids || !order) {
    fail("run", "out of memory");
    goto done;
  }
  int n_prompt;
  if (prompt_text) {
    if (!vocab_length) {
      fprintf(stderr, "run: -p needs %s/vocab.txt (build.py writes it); -i takes token ids\n", build_dir);
      goto done;
    }
    n_prompt = encode_text(prompt_text, vocab, vocab_length, ids, decoder.capacity);
  } else {
    n_prompt = parse_ids(prompt_ids, ids, decoder.capacity, decoder.vocab_size);
  }
  if (n_prompt < 1) {
    if (n_prompt == 0) fprintf(stderr, "run: the prompt is empty\n");
    goto done;
  }

  int end = n_prompt + steps;   /* the sequence's length when done */
  if (end > decoder.capacity) {
    fprintf(stderr, "run: stopping at %d tokens, the model's capacity (its block size)\n", decoder.capacity);
    end = decoder.capacity;
  }
  uint64_t rng = seed ^ 0x9E3779B97F4A7C15ull;   /* xorshift's state must not be 0 */
  int length = n_prompt;   /* tokens in `ids` */
  double prefill_seconds = 0.0, seconds = 0.0;
  const double start = now_s();
  while (length < end) {   /* the prefill gives the first token after the prompt, each step one more */
    const float* logits = length == n_prompt ? decoder_prefill(&decoder, ids, n_prompt)
                                             : decoder_step(&decoder, ids[length - 1]);
    if (!logits) goto done;
    if (length == n_prompt) prefill_seconds = now_s() - start;
    ids[length++] = temperature == 0.0f ? argmax(logits, decoder.vocab_size)
                                        : sample(logits, decoder.vocab_size, top_k, temperature, order, &rng);
  }
  seconds = now_s() - start;

  for (int i = 0; i < length; ++i) {
    if (raw || !vocab_length)
      printf(i ? " %d" : "%d", ids[i]);
    else
      putchar(vocab[ids[i]]);
  }
  printf("\n");
  const int generated = length - n_prompt;
  if (generated)
    fprintf(stderr, "%d token%s generated in %.4f s: %.1f tok/s (1 prefill call of %d prompt token%s, %.6f s, "
            "then %d decode call%s)\n", generated, generated == 1 ? "" : "s", seconds, generated / seconds, n_prompt,
            n_prompt == 1 ? "" : "s", prefill_seconds, generated - 1, generated == 2 ? "" : "s");
  else
    fprintf(stderr, "0 tokens generated: no calls\n");
  status = 0;
done:
  free(ids);
  free(order);
  decoder_close(&decoder);
  return status;
}
