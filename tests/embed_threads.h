/* Shared by the C API checks (embed_checks.c, embed_dynamic_checks.c): start `count` threads
 * running worker((void*)t) for t = 0 .. count-1 on one model, and add up what they return (each
 * worker's number of calls that disagreed with the single-threaded results). */
#ifndef FLOWGEN_TESTS_EMBED_THREADS_H
#define FLOWGEN_TESTS_EMBED_THREADS_H

#include <pthread.h>
#include <stddef.h>

static size_t run_workers(void* (*worker)(void*), int count) {
  pthread_t threads[64];
  size_t bad = 0;
  if (count > 64) count = 64;
  for (int t = 0; t < count; ++t) pthread_create(&threads[t], NULL, worker, (void*)(size_t)t);
  for (int t = 0; t < count; ++t) {
    void* result;
    pthread_join(threads[t], &result);
    bad += (size_t)result;
  }
  return bad;
}

#endif
