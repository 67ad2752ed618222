/* examples/generate/run.c: text generation without Python, in the manner of llama2.c's run.c.
 *
 * The model is a GPT decoding step built by examples/generate/build.py as a shared library with
 * flowgen's C API: each call takes one token, its position and the K/V caches of every layer,
 * and returns the next token's logits and the updated caches. This program feeds it the prompt,
 * one token per call, then its own choices: the argmax (greedy, -t 0) or a draw from the top-k
 * logits at a temperature, with its own seeded random numbers (the same seed, the same tokens).
 *
 *   python examples/generate/build.py --out gen      # prints the compile command, e.g.
 *   cc -std=c99 -O2 examples/generate/run.c -Igen/build -DFLOWGEN_MODEL_HEADER='"GPTDecode_0.h"' \
 *      -Lgen/build -lGPTDecode_0 -Wl,-rpath,"$PWD/gen/build" -lm -o gen/run
 *   ./gen/run gen/build -p "A graph is" -n 40 -t 0.8 -k 10 -s 7
 *
 * Options:
 *   -p TEXT   the prompt as text (needs BUILD_DIR/vocab.txt: the characters in token-id order)
 *   -i IDS    the prompt as token ids, comma separated (default: the token 0)
 *   -n N      tokens to generate (default 32); generation stops early at the model's capacity
 *   -t T      temperature (default 0: greedy, the argmax)
 *   -k K      sample from the K most likely tokens only (default 0: all of them)
 *   -s SEED   the sampler's seed (default 1)
 *   -r        print the token ids (prompt and generated), one line, instead of the text
 * Tokens per second go to stderr: the calls of the step (one per token of the prompt, then one per
 * generated token but the last, which needs none) over the time of those calls.
 *
 * The caches have a fixed capacity, the model's block size (flowgen has no dynamic dimensions
 * yet): a sequence is at most that long, and each step does the work of the full capacity.
 */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include FLOWGEN_MODEL_HEADER

/* ---------------------------------------------------------------------------------- the decoder */
/* The step's signature (build.py): input 0 the token, int64 [1, 1]; input 1 its position, int64
 * [1]; then the caches, float32 [1, n_head, capacity, head_dim] each. Output 0 the logits,
 * float32 [1, vocab_size]; then the caches, in the inputs' order. */
typedef struct {
  flowgen_model* model;
  int n_caches;
  int vocab_size;
  int capacity;              /* the caches' positions: the longest sequence */
  size_t cache_bytes;        /* one cache's size */
  float** caches;            /* ours: the caches the next step reads */
  int64_t token, pos;
  flowgen_tensor* inputs;    /* token, pos, caches... */
  flowgen_tensor* outputs;   /* logits, caches...: the model's memory until its next run */
} Decoder;

static int fail(const char* what, const char* why) {
  fprintf(stderr, "run: %s: %s\n", what, why);
  return 1;
}

static int expect_shape(const flowgen_tensor_info* info, int dtype, int ndim, const char* want) {
  if (info->dtype == dtype && info->ndim == ndim) return 0;
  fprintf(stderr, "run: %s is not %s (dtype %d, %d dims): this library is not a decoding step of "
          "examples/generate/build.py\n", info->name, want, info->dtype, info->ndim);
  return 1;
}

static int decoder_open(Decoder* d, const char* weights) {
  memset(d, 0, sizeof *d);
  const int n_inputs = flowgen_num_inputs(), n_outputs = flowgen_num_outputs();
  if (n_inputs < 4 || n_outputs != n_inputs - 1 || (n_inputs - 2) % 2 != 0) {
    fprintf(stderr, "run: the library takes %d inputs and gives %d outputs; a decoding step takes a token, "
            "a position and 2 caches per layer and gives the logits and the caches\n", n_inputs, n_outputs);
    return 1;
  }
  flowgen_tensor_info token, pos, logits, cache;
  flowgen_input_info(0, &token);
  flowgen_input_info(1, &pos);
  flowgen_output_info(0, &logits);
  flowgen_input_info(2, &cache);
  if (expect_shape(&token, FLOWGEN_INT64, 2, "int64 [1, 1]") || expect_shape(&pos, FLOWGEN_INT64, 1, "int64 [1]") ||
      expect_shape(&logits, FLOWGEN_FLOAT32, 2, "float32 [1, vocab]") ||
      expect_shape(&cache, FLOWGEN_FLOAT32, 4, "float32 [1, heads, capacity, head_dim]"))
    return 1;
  d->n_caches = n_inputs - 2;
  d->vocab_size = (int)logits.shape[1];
  d->capacity = (int)cache.shape[2];
  d->cache_bytes = sizeof(float);
  for (int k = 0; k < 4; ++k) d->cache_bytes *= (size_t)cache.shape[k];

  d->model = flowgen_create(weights);
  if (!d->model) return fail("flowgen_create", flowgen_last_error());
  d->inputs = calloc((size_t)n_inputs, sizeof(flowgen_tensor));
  d->outputs = calloc((size_t)n_outputs, sizeof(flowgen_tensor));
  d->caches = calloc((size_t)d->n_caches, sizeof(float*));
  if (!d->inputs || !d->outputs || !d->caches) return fail("decoder", "out of memory");
  d->inputs[0] = (flowgen_tensor){&d->token, FLOWGEN_INT64, 2, {1, 1}, FLOWGEN_HOST};
  d->inputs[1] = (flowgen_tensor){&d->pos, FLOWGEN_INT64, 1, {1}, FLOWGEN_HOST};
  for (int c = 0; c < d->n_caches; ++c) {
    d->caches[c] = calloc(1, d->cache_bytes);   /* a new sequence: empty (zero) caches */
    if (!d->caches[c]) return fail("decoder", "out of memory");
    flowgen_tensor* input = &d->inputs[2 + c];
    *input = (flowgen_tensor){d->caches[c], FLOWGEN_FLOAT32, 4, {0}, FLOWGEN_HOST};
    memcpy(input->shape, cache.shape, sizeof cache.shape);
  }
  return 0;
}

/* Run the step on `token` at `pos`; the logits (vocab_size floats, the model's memory until the
 * next step), or NULL with the library's message printed. */
static const float* decoder_step(Decoder* d, int token, int pos) {
  d->token = token;
  d->pos = pos;
  if (flowgen_run(d->model, d->inputs, 2 + d->n_caches, d->outputs, 1 + d->n_caches) != FLOWGEN_OK) {
    fail("flowgen_run", flowgen_last_error());
    return NULL;
  }
  /* The updated caches belong to the model until its next run, which reads ours: copy them. */
  for (int c = 0; c < d->n_caches; ++c) memcpy(d->caches[c], d->outputs[1 + c].data, d->cache_bytes);
  return d->outputs[0].data;
}

static void decoder_close(Decoder* d) {
  if (d->caches)
    for (int c = 0; c < d->n_caches; ++c) free(d->caches[c]);
  free(d->caches);
  free(d->inputs);
  free(d->outputs);
  flowgen_destroy(d->model);
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

  char weights[4096];
  snprintf(weights, sizeof weights, "%s/weights.safetensors", build_dir);
  Decoder decoder;
  int status = 1;
  int* ids = NULL;
  int* order = NULL;
  if (decoder_open(&decoder, weights) != 0) goto done;
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
  int calls = 0;
  const double start = now_s();
  for (int pos = 0; length < end; ++pos) {   /* the prompt's tokens fill the caches, then each call adds one */
    const float* logits = decoder_step(&decoder, ids[pos], pos);
    if (!logits) goto done;
    ++calls;
    if (pos + 1 == length)
      ids[length++] = temperature == 0.0f ? argmax(logits, decoder.vocab_size)
                                          : sample(logits, decoder.vocab_size, top_k, temperature, order, &rng);
  }
  const double seconds = now_s() - start;

  for (int i = 0; i < length; ++i) {
    if (raw || !vocab_length)
      printf(i ? " %d" : "%d", ids[i]);
    else
      putchar(vocab[ids[i]]);
  }
  printf("\n");
  fprintf(stderr, "%d calls (%d prompt tokens, %d generated) in %.4f s: %.1f tok/s\n", calls, n_prompt,
          length - n_prompt, seconds, calls / seconds);
  status = 0;
done:
  free(ids);
  free(order);
  decoder_close(&decoder);
  return status;
}
