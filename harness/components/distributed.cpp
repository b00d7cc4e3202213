// Process group, gradient reducer and launch variables (distributed.h). The c10d headers are
// included only here: with COLLIDER_DISTRIBUTED off this file compiles to stubs that say how to
// enable it. Gloo's own code comes from libtorch_cpu (the gloo headers only describe it).
#include "harness/components/distributed.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <unordered_set>

#if COLLIDER_DISTRIBUTED
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if COLLIDER_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#endif

namespace collider::harness {
namespace {

// The value of an integer variable, or `fallback` when unset; malformed values are errors.
int env_int(const char* name, std::optional<int> fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (fallback) return *fallback;
    throw std::invalid_argument(
        fmt::format("{} is not set; a distributed run needs RANK, WORLD_SIZE, MASTER_ADDR and "
                    "MASTER_PORT (scripts/launch.sh, torchrun or srun set them)",
                    name));
  }
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi) {
    throw std::invalid_argument(fmt::format("{}='{}' must be an integer in [{}, {}]", name, v, lo, hi));
  }
  return static_cast<int>(x);
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::optional<DistEnv> dist_env_from_environment() {
  const char* ws = std::getenv("WORLD_SIZE");
  if (ws == nullptr || *ws == '\0') return std::nullopt;
  DistEnv e;
  e.world_size = env_int("WORLD_SIZE", std::nullopt, 1, 1 << 20);
  e.rank = env_int("RANK", std::nullopt, 0, e.world_size - 1);
  e.local_rank = env_int("LOCAL_RANK", e.rank, 0, e.world_size - 1);
  const char* addr = std::getenv("MASTER_ADDR");
  if (e.world_size > 1 && (addr == nullptr || *addr == '\0')) {
    throw std::invalid_argument("MASTER_ADDR is not set; it names the host of rank 0 (127.0.0.1 for one machine)");
  }
  if (addr != nullptr && *addr != '\0') e.master_addr = addr;
  e.master_port = env_int("MASTER_PORT", e.world_size > 1 ? std::nullopt : std::optional<int>(29500), 1, 65535);
  const int timeout_s = env_int("COLLIDER_DIST_TIMEOUT_S", 300, 1, 7 * 24 * 3600);
  e.timeout = std::chrono::seconds(timeout_s);
  return e;
}

void run_on_rank0(ProcessGroup* pg, const std::function<void()>& fn) {
  if (pg == nullptr || pg->rank() == 0) fn();
  if (pg != nullptr) pg->barrier("barrier after a rank-0-only write");
}

#if COLLIDER_DISTRIBUTED

bool distributed_available() { return true; }

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

ProcessGroup::ProcessGroup(DistEnv env, std::string backend, std::unique_ptr<Impl> impl)
    : env_(std::move(env)), backend_(std::move(backend)), impl_(std::move(impl)) {}

ProcessGroup::~ProcessGroup() = default;

namespace {

[[noreturn]] void rethrow_collective(const DistEnv& env, const std::string& backend, const char* op, const char* what,
                                     const std::exception& e) {
  std::string msg = e.what();
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) msg = ce->what_without_backtrace();
  throw DistributedError(fmt::format(
      "rank {} of {}: {} ({}, {}) failed: {}. A peer rank died, hung past the {} s timeout (COLLIDER_DIST_TIMEOUT_S), "
      "or ran a different collective; the run ends on every rank",
      env.rank, env.world_size, op, what, backend, msg,
      std::chrono::duration_cast<std::chrono::seconds>(env.timeout).count()));
}

}  // namespace

void ProcessGroup::all_reduce_sum(std::vector<torch::Tensor>& tensors, const char* what) {
  try {
    // One collective per tensor, all in flight before the first wait (Gloo runs them on its threads).
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    works.reserve(tensors.size());
    for (auto& t : tensors) {
      std::vector<at::Tensor> one = {t};
      works.push_back(impl_->backend->allreduce(one));
    }
    for (auto& w : works) w->wait(env_.timeout);
  } catch (const std::exception& e) { rethrow_collective(env_, backend_, "all-reduce", what, e); }
}

struct ProcessGroup::Pending {
  c10::intrusive_ptr<c10d::Work> work;
};

std::shared_ptr<ProcessGroup::Pending> ProcessGroup::start_all_reduce_sum(torch::Tensor& tensor) {
  auto p = std::make_shared<Pending>();
  try {
    std::vector<at::Tensor> one = {tensor};
    p->work = impl_->backend->allreduce(one);
  } catch (const std::exception& e) {
    rethrow_collective(env_, backend_, "all-reduce", "starting a gradient bucket", e);
  }
  return p;
}

void ProcessGroup::wait(Pending& pending, const char* what) {
  try {
    pending.work->wait(env_.timeout);
  } catch (const std::exception& e) { rethrow_collective(env_, backend_, "all-reduce", what, e); }
}

void ProcessGroup::broadcast(std::vector<torch::Tensor>& tensors, int root, const char* what) {
  try {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& t : tensors) {
      std::vector<at::Tensor> one = {t};
      works.push_back(impl_->backend->broadcast(one, o));
    }
    for (auto& w : works) w->wait(env_.timeout);
  } catch (const std::exception& e) { rethrow_collective(env_, backend_, "broadcast", what, e); }
}

void ProcessGroup::barrier(const char* what) {
  try {
    c10d::BarrierOptions o;
    o.timeout = env_.timeout;
    impl_->backend->barrier(o)->wait(env_.timeout);
  } catch (const std::exception& e) { rethrow_collective(env_, backend_, "barrier", what, e); }
}

std::shared_ptr<ProcessGroup> init_process_group(const DistEnv& env, const torch::Device& device) {
  const auto timeout_s = std::chrono::duration_cast<std::chrono::seconds>(env.timeout).count();
  auto impl = std::make_unique<ProcessGroup::Impl>();
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.waitWorkers = true;
    so.timeout = env.timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) msg = ce->what_without_backtrace();
    throw DistributedError(fmt::format(
        "rank {} of {}: rendezvous at {}:{} failed within {} s ({}): {}. Check that every rank was started with the "
        "same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, and that the port is free on rank 0's host",
        env.rank, env.world_size, env.master_addr, env.master_port, timeout_s,
        env.rank == 0 ? "serving the TCPStore, waiting for every rank" : "joining rank 0's TCPStore", msg));
  }
  std::string backend = "gloo";
  try {
#if COLLIDER_HAVE_NCCL
    if (device.is_cuda()) {
      backend = "nccl";
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(device.has_index() ? device.index() : env.local_rank));
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = env.timeout;
      impl->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl->store, env.rank, env.world_size, opts);
    }
#endif
    if (!impl->backend) {
      auto opts = c10d::ProcessGroupGloo::Options::create(env.timeout);
      // Loopback runs bind to 127.0.0.1; GLOO_SOCKET_IFNAME picks an interface (as in PyTorch);
      // else this host's name.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      const bool loopback = env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0;
      if (ifname != nullptr && *ifname != '\0') {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (loopback) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, env.rank, env.world_size, opts);
    }
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) msg = ce->what_without_backtrace();
    throw DistributedError(fmt::format("rank {} of {}: creating the {} process group failed within {} s: {}", env.rank,
                                       env.world_size, backend, timeout_s, msg));
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(env, backend, std::move(impl)));
}

#else  // !COLLIDER_DISTRIBUTED

bool distributed_available() { return false; }

struct ProcessGroup::Impl {};
ProcessGroup::ProcessGroup(DistEnv env, std::string backend, std::unique_ptr<Impl> impl)
    : env_(std::move(env)), backend_(std::move(backend)), impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

namespace {
[[noreturn]] void not_built() {
  throw std::runtime_error(
      "this build has no data-parallel training (COLLIDER_DISTRIBUTED is OFF: the gloo headers were not found at "
      "configure time); `apt-get install libgloo-dev` (or ./scripts/bootstrap.sh) and reconfigure, or unset WORLD_SIZE "
      "for a single-process run");
}
}  // namespace

void ProcessGroup::all_reduce_sum(std::vector<torch::Tensor>&, const char*) { not_built(); }
struct ProcessGroup::Pending {};
std::shared_ptr<ProcessGroup::Pending> ProcessGroup::start_all_reduce_sum(torch::Tensor&) { not_built(); }
void ProcessGroup::wait(Pending&, const char*) { not_built(); }
void ProcessGroup::broadcast(std::vector<torch::Tensor>&, int, const char*) { not_built(); }
void ProcessGroup::barrier(const char*) { not_built(); }
std::shared_ptr<ProcessGroup> init_process_group(const DistEnv&, const torch::Device&) { not_built(); }

#endif  // COLLIDER_DISTRIBUTED

// ---- GradientReducer (backend-independent: only ProcessGroup's collectives) ----------------------

namespace {

// Runs after a parameter's AccumulateGrad node: its .grad() holds this backward's gradient.
struct ReadyHook : torch::autograd::FunctionPostHook {
  explicit ReadyHook(std::function<void()> fn) : fn(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn();
    return outputs;
  }
  std::function<void()> fn;
};

}  // namespace

GradientReducer::GradientReducer(std::shared_ptr<ProcessGroup> pg, const std::vector<torch::Tensor>& params,
                                 ReducerOptions options)
    : pg_(std::move(pg)), options_(options) {
  TORCH_CHECK(pg_ != nullptr, "GradientReducer: no process group given");
  TORCH_CHECK(options_.bucket_bytes > 0, "GradientReducer: bucket_bytes must be positive, got ", options_.bucket_bytes);
  if (const char* v = std::getenv("COLLIDER_DIST_OVERLAP"); v != nullptr && std::string(v) == "0") {
    options_.overlap_backward = false;
  }
  std::unordered_set<const void*> seen;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {  // backward produces the last layers first
    if (!it->requires_grad() || !seen.insert(it->unsafeGetTensorImpl()).second) continue;
    params_.push_back(*it);
  }
  int64_t bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    const int64_t b = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fits = !buckets_.empty() && bytes + b <= options_.bucket_bytes &&
                      params_[buckets_.back().front()].scalar_type() == p.scalar_type() &&
                      params_[buckets_.back().front()].device() == p.device();
    if (!fits) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(i);
    bucket_of_.push_back(buckets_.size() - 1);
    bytes += b;
  }
  // Every replica starts from rank 0's parameters (the same seed gives the same ones; this makes sure).
  {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> data;
    for (auto& p : params_) data.push_back(p.detach());
    pg_->broadcast(data, 0, "rank 0's initial parameters");
  }
  if (options_.overlap_backward) {
    // A leaf's AccumulateGrad node runs once per backward (uses of a tied weight are summed
    // before it); holding the nodes keeps the same ones, and their hooks, in every graph.
    for (size_t i = 0; i < params_.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_CHECK(acc != nullptr, "GradientReducer: parameter ", i, " has no gradient accumulator");
      hook_keys_.push_back(acc->add_post_hook(std::make_unique<ReadyHook>([this, i] { mark_ready(i); })));
      accumulators_.push_back(std::move(acc));
    }
  }
}

GradientReducer::~GradientReducer() {
  // The accumulators may outlive us (a live graph holds them): remove our hooks.
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void GradientReducer::begin(double local_loss, int64_t local_tokens_kept, int64_t local_tokens) {
  torch::NoGradGuard ng;
  const double t0 = now_ms();
  const int W = pg_->world_size(), R = pg_->rank();
  ReduceStats st;
  const torch::Device dev = params_.empty() ? torch::Device(torch::kCPU) : params_.front().device();

  // Per-rank (loss, kept, tokens): each rank fills its row, the sum gives every row to everyone.
  auto meta_W3 = torch::zeros({W, 3}, torch::kDouble);
  meta_W3[R][0].fill_(local_loss);
  meta_W3[R][1].fill_(static_cast<double>(local_tokens_kept));
  meta_W3[R][2].fill_(static_cast<double>(local_tokens));
  std::vector<torch::Tensor> meta = {meta_W3.to(dev)};
  pg_->all_reduce_sum(meta, "per-rank losses and kept counts");
  const auto m = meta[0].cpu();
  const auto acc = m.accessor<double, 2>();
  double weighted = 0.0;
  for (int r = 0; r < W; ++r) {
    st.rank_loss.push_back(acc[r][0]);
    st.rank_tokens_kept.push_back(static_cast<int64_t>(acc[r][1]));
    st.rank_tokens.push_back(static_cast<int64_t>(acc[r][2]));
    st.tokens_kept += st.rank_tokens_kept.back();
    st.tokens += st.rank_tokens.back();
    weighted += acc[r][0] * acc[r][1];
  }
  st.loss = st.tokens_kept > 0 ? weighted / static_cast<double>(st.tokens_kept) : 0.0;

  std::lock_guard<std::mutex> lock(mutex_);
  stats_ = std::move(st);
  // This rank's share of the global mean; with no kept token anywhere, a plain average.
  scale_ = stats_.tokens_kept > 0 ? static_cast<double>(local_tokens_kept) / static_cast<double>(stats_.tokens_kept)
                                  : 1.0 / W;
  param_ready_.assign(params_.size(), 0);
  bucket_ready_count_.assign(buckets_.size(), 0);
  next_bucket_ = 0;
  flats_.assign(buckets_.size(), torch::Tensor());
  pending_.assign(buckets_.size(), nullptr);
  buckets_started_in_backward_ = 0;
  armed_ = true;
  t_begin_ms_ = t0;
  begin_ms_ = now_ms() - t0;
}

void GradientReducer::mark_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_ || param_ready_[i]) return;
  param_ready_[i] = 1;
  ++bucket_ready_count_[bucket_of_[i]];
  const size_t before = next_bucket_;
  start_ready_buckets(/*all=*/false);
  buckets_started_in_backward_ += static_cast<int64_t>(next_bucket_ - before);
}

void GradientReducer::start_ready_buckets(bool all) {
  torch::NoGradGuard ng;
  while (next_bucket_ < buckets_.size()) {
    const auto& bucket = buckets_[next_bucket_];
    if (!all && bucket_ready_count_[next_bucket_] < static_cast<int64_t>(bucket.size())) break;
    std::vector<torch::Tensor> parts;
    parts.reserve(bucket.size());
    for (size_t i : bucket) {
      const auto& p = params_[i];
      const auto& g = p.grad();
      parts.push_back(g.defined() ? g.reshape(-1) : torch::zeros({p.numel()}, p.options()));
    }
    flats_[next_bucket_] = torch::cat(parts).mul_(scale_);
    pending_[next_bucket_] = pg_->start_all_reduce_sum(flats_[next_bucket_]);
    ++next_bucket_;
  }
}

ReduceStats GradientReducer::finish() {
  torch::NoGradGuard ng;
  const double t0 = now_ms();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(armed_, "GradientReducer::finish: call begin() first (before backward)");
  armed_ = false;
  start_ready_buckets(/*all=*/true);
  for (size_t b = 0; b < buckets_.size(); ++b) pg_->wait(*pending_[b], "gradient buckets");
  for (size_t b = 0; b < buckets_.size(); ++b) {
    int64_t off = 0;
    for (size_t i : buckets_[b]) {
      auto& p = params_[i];
      auto slice = flats_[b].narrow(0, off, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(slice);
      } else {
        p.mutable_grad() = slice.clone();
      }
      off += p.numel();
    }
  }
  const torch::Device dev = params_.empty() ? torch::Device(torch::kCPU) : params_.front().device();
  if (dev.is_cuda()) torch::cuda::synchronize();  // NCCL waits are stream waits: time the finished copies
  ReduceStats st = std::move(stats_);
  for (const auto& f : flats_) st.bytes += f.numel() * static_cast<int64_t>(f.element_size());
  st.num_buckets = static_cast<int64_t>(buckets_.size());
  st.buckets_overlapped = buckets_started_in_backward_;
  st.wait_ms = begin_ms_;
  st.bucket_ms = now_ms() - t0;
  st.allreduce_ms = st.wait_ms + st.bucket_ms;
  flats_.clear();
  pending_.clear();
  return st;
}

ReduceStats GradientReducer::reduce(double local_loss, int64_t local_tokens_kept, int64_t local_tokens) {
  begin(local_loss, local_tokens_kept, local_tokens);
  return finish();
}

}  // namespace collider::harness
