// cold_copy_ms (probes.h).
#include "harness/measure/probes.h"

#include <chrono>

namespace collider::harness {

double cold_copy_ms(int64_t bytes, const torch::Device& device) {
  if (bytes <= 0) return 0;
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  auto src = torch::rand({bytes / 4}, opts), dst = torch::zeros({bytes / 4}, opts);
  torch::empty({(int64_t(64) << 20) / 4}, opts).fill_(1.0);
  sync();
  const auto t0 = std::chrono::steady_clock::now();
  dst.copy_(src);
  sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace collider::harness
