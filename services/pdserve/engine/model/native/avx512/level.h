// What model.cpp calls at the AVX-512 levels (avx512, avx512_bf16, amx: the same sources built
// with more of the CPU's instructions enabled; the AVX512-BF16 and AMX paths compile where the
// build enables them).
#pragma once
#include "attention.h"
#include "blocked_linear.h"
#include "elementwise.h"

namespace pdserve {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr const char* kLevel = "amx";
#elif defined(__AVX512BF16__)
constexpr const char* kLevel = "avx512_bf16";
#else
constexpr const char* kLevel = "avx512";
#endif

// float32 prompt chunks that start a sequence go to torch's flash attention, which beats the
// float paged kernel on long prompts at this level (model.cpp, `attention`).
constexpr bool kFlashFloatPrompts = true;

}  // namespace pdserve
