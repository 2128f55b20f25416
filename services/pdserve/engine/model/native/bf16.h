// bfloat16 as raw 16-bit storage and its scalar conversions, shared by every ISA level (no
// vector instructions here, so the header means the same in each level's translation unit).
#pragma once
#include <cstdint>
#include <cstring>

namespace pdserve {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch rounds float -> bfloat16 (NaN stays NaN).
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16 from_float<bf16>(float f) { return to_bf16(f); }

// What a value becomes once stored in T and read back (the rounding torch applies per op).
template <typename T> inline float rounded(float f) { return to_float(from_float<T>(f)); }

}  // namespace pdserve
