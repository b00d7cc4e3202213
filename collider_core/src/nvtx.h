// Internal: RAII NVTX range in the `collider` domain; compiled out without the nvtx3 headers.
#pragma once

#ifdef COLLIDER_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace collider::detail {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#ifdef COLLIDER_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#ifdef COLLIDER_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace collider::detail
