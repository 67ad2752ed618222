// flowgen_philox.h: the Philox4x32-10 stream used by dropout and the random ops, for kernels.
// It must match flowgen/random.py bit for bit (see that module's docstring): word `idx` of
// stream (seed, offset) is word idx % 4 of philox(counter, key) with
//   key = (seed lo32, seed hi32), counter = (idx / 4, offset lo32, offset hi32, 0);
// a uniform in [0, 1) is (word >> 8) * 2^-24.
#pragma once

// Philox4x32-10 block `counter` of stream (seed, offset): its four words.
__device__ __forceinline__ void flowgen_philox_block(unsigned long long seed, unsigned long long offset,
                                                     unsigned int counter, unsigned int words[4]) {
  unsigned int c0 = counter, c1 = (unsigned int)offset, c2 = (unsigned int)(offset >> 32), c3 = 0u;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = (unsigned long long)0xD2511F53u * c0;
    const unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c2;
    const unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ k0, n1 = (unsigned int)p1;
    const unsigned int n2 = (unsigned int)(p0 >> 32) ^ c3 ^ k1, n3 = (unsigned int)p0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
  }
  words[0] = c0; words[1] = c1; words[2] = c2; words[3] = c3;
}

__device__ __forceinline__ unsigned int flowgen_philox_word(unsigned long long seed, unsigned long long offset,
                                                            long long idx) {
  unsigned int w[4];
  flowgen_philox_block(seed, offset, (unsigned int)((unsigned long long)idx >> 2), w);
  // Constant indices only, so the block stays in registers on a GPU.
  return ((idx & 3) == 0) ? w[0] : ((idx & 3) == 1) ? w[1] : ((idx & 3) == 2) ? w[2] : w[3];
}

__device__ __forceinline__ float flowgen_philox_uniform(unsigned long long seed, unsigned long long offset,
                                                        long long idx) {
  return (float)(flowgen_philox_word(seed, offset, idx) >> 8) * (1.0f / 16777216.0f);
}

// Box-Muller over words 2i and 2i + 1, in double: sqrt(-2 log(1 - u0)) * cos(2 pi u1).
__device__ __forceinline__ double flowgen_philox_normal(unsigned long long seed, unsigned long long offset,
                                                        long long idx) {
  const double u0 = (double)flowgen_philox_uniform(seed, offset, 2 * idx);
  const double u1 = (double)flowgen_philox_uniform(seed, offset, 2 * idx + 1);
  return sqrt(-2.0 * log(1.0 - u0)) * cos(6.283185307179586 * u1);
}

// An integer in [0, range): the 64-bit word pair (2i, 2i + 1) modulo range.
__device__ __forceinline__ unsigned long long flowgen_philox_below(unsigned long long seed, unsigned long long offset,
                                                                  long long idx, unsigned long long range) {
  const unsigned long long hi = flowgen_philox_word(seed, offset, 2 * idx);
  const unsigned long long lo = flowgen_philox_word(seed, offset, 2 * idx + 1);
  return ((hi << 32) | lo) % range;
}
