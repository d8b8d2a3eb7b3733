// Per-thread scratch memory shared by the native CPU ops (quant.cpp, half.cpp): one buffer per
// thread that only grows, 64-byte aligned. Decode calls these ops hundreds of times a step, so
// they allocate nothing per call; a fresh weight-sized buffer would also cost its page faults at
// every call. The ops never nest, so one buffer serves them all; its contents are valid only
// during the call that asked for it.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>

namespace shardwise_native {

inline uint8_t* scratch_bytes(int64_t bytes) {
  struct Buffer {
    void* p = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(p); }
  };
  static thread_local Buffer buf;
  if (buf.size < bytes) {
    std::free(buf.p);
    buf.p = nullptr;
    buf.size = 0;
    const int64_t size = (bytes + 4095) / 4096 * 4096;
    buf.p = std::aligned_alloc(64, size);
    TORCH_CHECK(buf.p != nullptr, "shardwise native CPU op: cannot allocate ", size,
                " scratch bytes");
    buf.size = size;
  }
  return static_cast<uint8_t*>(buf.p);
}

}  // namespace shardwise_native
