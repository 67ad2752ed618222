// flowgen_philox.h: the Philox4x32-10 uniform stream used by dropout, for kernels.
// It must match flowgen/random.py bit for bit (see that module's docstring): element
// `idx` of stream (seed, offset) is word idx % 4 of philox(counter, key) with
//   key = (seed lo32, seed hi32), counter = (idx / 4, offset lo32, offset hi32, 0),
// scaled as (r >> 8) * 2^-24.
#pragma once

__device__ __forceinline__ float flowgen_philox_uniform(unsigned long long seed, unsigned long long offset,
                                                        long long idx) {
  unsigned int c0 = (unsigned int)((unsigned long long)idx >> 2), c1 = (unsigned int)offset;
  unsigned int c2 = (unsigned int)(offset >> 32), c3 = 0u;
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
  const unsigned int word = ((idx & 3) == 0) ? c0 : ((idx & 3) == 1) ? c1 : ((idx & 3) == 2) ? c2 : c3;
  return (float)(word >> 8) * (1.0f / 16777216.0f);
}
