// Math that the attention kernels (forward and backward) share.
#pragma once

namespace attention_math {

// 2^x by the SFU alone (ex2.approx.ftz: 2 ulp; results below 2^-126 flush to 0, which a
// softmax's P, rounded to T or summed in fp32 against the row's maximum's 1, never misses).
// exp2f adds a test and two multiplies per element for those tiny results, and the softmax's
// ALU work is what the tensor cores wait on at small head dims.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe, for a finite x <= 0 (no -inf: a masked score needs exp2_ftz's exact 0):
// x = j + f, j the nearest integer (by adding 1.5 * 2^23, whose low mantissa bits then hold
// j), f in [-1/2, 1/2]; 2^f by a degree-4 polynomial (relative error 3.1e-6 in fp32 Horner);
// j added to its exponent field. x below -126 gives 2^-126, which is 0 to a softmax's P. Where
// the SFU's ex2 is the bottleneck (a softmax at small head dims), some of a row's exponentials
// computed here finish sooner: the two pipes run side by side.
__device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  x = fmaxf(x, -126.f);
  const float t = __fadd_rn(x, kRound);  // (_rn: not folded away with the next line)
  const float f = __fsub_rn(x, __fsub_rn(t, kRound));
  float p = 9.60039347e-3f;
  p = fmaf(p, f, 5.59153557e-2f);
  p = fmaf(p, f, 2.40237206e-1f);
  p = fmaf(p, f, 6.93122327e-1f);
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));  // t's low bits: j
}

}  // namespace attention_math
