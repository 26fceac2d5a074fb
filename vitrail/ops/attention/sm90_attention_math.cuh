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

}  // namespace attention_math
