// Eight-lane float vectors (GCC/Clang vector extensions; AVX2 where the library is built with
// it) and the few functions kvserve's native ops share. Everything here rounds the same way
// wherever it is used: the library is compiled with -ffp-contract=off.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvs {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
// a * b + c: one rounding where the CPU has FMA, else two; everywhere the same (the library is
// compiled with -ffp-contract=off, so no other product and sum is fused behind our back)
inline v8 fmadd(v8 a, v8 b, v8 c) {
#ifdef __FMA__
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
// The sum of v's lanes in the order reduce8 takes for each of its vectors: ((0+1)+(2+3)) +
// ((4+5)+(6+7)).
inline float hsum(v8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// exp on 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes's
// coefficients), 2^n through the exponent bits. Relative error below 2e-7 on [-87, 88].
inline v8 exp8(v8 x) {
  const v8 hi = splat(88.3762626647949f), lo = splat(-87.3365478515625f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v8 fx = x * splat(1.44269504088896341f);
  const v8 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const v8 t = fx + magic;
  const v8 n = t - magic;
  v8 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.f);
  typedef int32_t i8v __attribute__((vector_size(32)));
  const i8v e = (((i8v)t - (i8v)magic) + 127) << 23;
  const v8 scale = (v8)e;
  return p * scale;
}

}  // namespace kvs
