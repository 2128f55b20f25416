// The q and k heads' RMSNorms (Qwen3, Gemma 3), as the levels' `rope_and_store` takes them: a
// weight of head_dim for every q head and one for every k head, both null where the model has none.
#pragma once

namespace pdserve {

template <typename T>
struct HeadNorms {
  const T* q = nullptr;
  const T* k = nullptr;
  float eps = 0.0f;
};

}  // namespace pdserve
