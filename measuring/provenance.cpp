// Provenance (provenance.h): git through popen, the CPU's model from /proc/cpuinfo, a GPU's name
// through the CUDA driver looked up at run time (no CUDA headers needed).
#include "measuring/provenance.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/headeronly/version.h>

#include <dlfcn.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>

namespace collider {

namespace {

std::string run_command(const std::string& cmd, bool* ok) {
  std::array<char, 512> buf{};
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    if (ok) *ok = false;
    return out;
  }
  while (fgets(buf.data(), buf.size(), p)) out += buf.data();
  const int rc = ::pclose(p);
  if (ok) *ok = rc == 0;
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      if (c != std::string::npos) return line.substr(line.find_first_not_of(' ', c + 1));
    }
  }
  return "unknown CPU";
}

// GPU name through the CUDA driver API, looked up at run time (no CUDA headers needed).
std::string cuda_device_name(int ordinal) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return "unknown CUDA device";
  using GetFn = int (*)(int*, int);
  using NameFn = int (*)(char*, int, int);
  auto get = reinterpret_cast<GetFn>(dlsym(h, "cuDeviceGet"));
  auto name = reinterpret_cast<NameFn>(dlsym(h, "cuDeviceGetName"));
  int dev = 0;
  std::array<char, 256> buf{};
  if (!get || !name || get(&dev, ordinal) != 0 || name(buf.data(), static_cast<int>(buf.size()), dev) != 0) {
    return "unknown CUDA device";
  }
  return buf.data();
}

}  // namespace

Provenance collect_provenance(const torch::Device& device, const std::string& source_dir) {
  Provenance p;
  bool ok = false;
  p.git_sha = run_command("git -C '" + source_dir + "' rev-parse HEAD 2>/dev/null", &ok);
  if (!ok || p.git_sha.empty()) p.git_sha = "unknown";
  bool ok2 = false;
  const std::string dirty =
      run_command("git -C '" + source_dir + "' status --porcelain --untracked-files=no 2>/dev/null", &ok2);
  p.git_dirty = ok2 && !dirty.empty();
  p.torch_version = TORCH_VERSION;
  if (torch::cuda::is_available()) {
    try {
      const long v = at::detail::getCUDAHooks().versionCUDART();
      p.cuda_version = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    } catch (const std::exception&) { p.cuda_version = "unknown"; }
  }
  p.device_name = device.is_cuda() ? cuda_device_name(device.has_index() ? device.index() : 0) : cpu_model_name();
  p.num_threads = at::get_num_threads();
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) == 0) p.hostname = host.data();
  return p;
}

}  // namespace collider
