// Marker autograd function and per-layer segment bookkeeping (layer_timing.h).
#include "harness/components/layer_timing.h"

#include <collider/collider.h>

#include <fmt/format.h>

#include <map>
#include <stdexcept>

namespace collider::harness {
namespace {

// Live LayerTimers by id, so that a graph that outlives its timer finds nothing instead of a
// dangling pointer.
std::mutex g_registry_mu;
std::map<int64_t, LayerTimer*> g_registry;
int64_t g_next_id = 1;

LayerTimer* lookup(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  return it == g_registry.end() ? nullptr : it->second;
}

// Identity in forward and backward; records the crossing. Saves two integers, nothing
// token-shaped; maps gradient rows one to one (passthrough for the rewriter).
struct BoundaryMarker : public torch::autograd::Function<BoundaryMarker> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_BTD, int64_t timer_id,
                               int64_t boundary) {
    ctx->saved_data["timer"] = timer_id;
    ctx->saved_data["boundary"] = boundary;
    if (LayerTimer* t = lookup(timer_id)) t->on_marker_forward(boundary);
    return x_BTD;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (LayerTimer* t = lookup(ctx->saved_data["timer"].toInt()))
      t->on_marker_backward(ctx->saved_data["boundary"].toInt());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

std::once_flag g_register_once;
std::string g_marker_name;

void register_marker_once() {
  std::call_once(g_register_once, [] {
    // The node's name as the autograd graph reports it, read from a real instance.
    auto x = torch::zeros({1, 1, 1}, torch::requires_grad());
    auto y = BoundaryMarker::apply(x, int64_t{0}, int64_t{0});
    TORCH_CHECK(y.grad_fn(), "layer timing: the marker produced no autograd node");
    g_marker_name = y.grad_fn()->name();
    collider::register_passthrough_node(g_marker_name);
  });
}

}  // namespace

std::string LayerTimer::marker_node_name() {
  register_marker_once();
  return g_marker_name;
}

LayerTimer::LayerTimer(Timer* timer, RangeRecorder* ranges) : timer_(timer), ranges_(ranges) { register_marker_once(); }

LayerTimer::~LayerTimer() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (auto it = g_registry.begin(); it != g_registry.end();) {
    it = it->second == this ? g_registry.erase(it) : std::next(it);
  }
}

void LayerTimer::install(models::CausalLM& model) {
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    id = g_next_id++;
    g_registry[id] = this;
  }
  model->set_boundary_hook([this, id](const torch::Tensor& x_BTD, const std::string& name) {
    const int64_t b = boundary_index(name);
    return BoundaryMarker::apply(x_BTD, id, b);
  });
}

int64_t LayerTimer::boundary_index(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < boundaries_.size(); ++i) {
    if (boundaries_[i] == name) return static_cast<int64_t>(i);
  }
  boundaries_.push_back(name);
  fwd_marks_.resize(boundaries_.size(), -1);
  bwd_marks_.resize(boundaries_.size(), -1);
  return static_cast<int64_t>(boundaries_.size()) - 1;
}

std::string LayerTimer::segment_after(int64_t b) const {
  return b + 1 < static_cast<int64_t>(boundaries_.size()) ? boundaries_[b + 1] : std::string("lm_head");
}

std::string LayerTimer::segment_before(int64_t b) const { return boundaries_[b]; }

void LayerTimer::forward_begin() {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(fwd_marks_.begin(), fwd_marks_.end(), -1);
  std::fill(bwd_marks_.begin(), bwd_marks_.end(), -1);
  fwd_order_.clear();
  bwd_order_.clear();
  fwd_end_ = bwd_begin_ = bwd_end_ = -1;
  fwd_begin_ = timer_->mark();
  if (ranges_) {
    ranges_->end(open_range_);
    open_range_ = ranges_->begin(boundaries_.empty() ? std::string("embedding.fwd") : boundaries_[0] + ".fwd");
  }
}

void LayerTimer::on_marker_forward(int64_t b) {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mu_);
  fwd_marks_[b] = timer_->mark();
  fwd_order_.push_back(b);
  if (ranges_) {
    ranges_->end(open_range_);
    open_range_ = ranges_->begin(segment_after(b) + ".fwd");
  }
}

void LayerTimer::forward_end() {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mu_);
  fwd_end_ = timer_->mark();
  if (ranges_) ranges_->end(open_range_);
  open_range_ = 0;
}

void LayerTimer::backward_begin() {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mu_);
  bwd_begin_ = timer_->mark();
  if (ranges_) open_range_ = ranges_->begin("lm_head.bwd");
}

void LayerTimer::on_marker_backward(int64_t b) {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (bwd_begin_ < 0) return;  // a backward outside a timed step
  bwd_marks_[b] = timer_->mark();
  bwd_order_.push_back(b);
  if (ranges_) {
    ranges_->end(open_range_);
    open_range_ = ranges_->begin(segment_before(b) + ".bwd");
  }
}

void LayerTimer::backward_end() {
  if (!recording_) return;
  std::lock_guard<std::mutex> lock(mu_);
  bwd_end_ = timer_->mark();
  if (ranges_) ranges_->end(open_range_);
  open_range_ = 0;
}

std::vector<std::string> LayerTimer::forward_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (int64_t b : fwd_order_) out.push_back(boundaries_[b]);
  return out;
}

std::vector<std::string> LayerTimer::backward_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (int64_t b : bwd_order_) out.push_back(boundaries_[b]);
  return out;
}

std::vector<LayerTime> LayerTimer::resolve() const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t n = static_cast<int64_t>(boundaries_.size());
  if (n == 0 || fwd_begin_ < 0 || fwd_end_ < 0) {
    throw std::runtime_error("layer timing: no timed forward in this step (did the model call its boundary hook?)");
  }
  for (int64_t b = 0; b < n; ++b) {
    if (fwd_marks_[b] < 0) {
      throw std::runtime_error(
          fmt::format("layer timing: the forward marker at boundary '{}' did not fire", boundaries_[b]));
    }
  }
  const bool have_bwd = bwd_begin_ >= 0 && bwd_end_ >= 0;
  if (have_bwd) {
    for (int64_t b = 0; b < n; ++b) {
      if (bwd_marks_[b] < 0) {
        throw std::runtime_error(fmt::format(
            "layer timing: the gradient never passed the marker at boundary '{}' (was the marker node dropped "
            "from the backward graph?)",
            boundaries_[b]));
      }
    }
    // Backward must cross the boundaries in reverse forward order, else segments are not layers.
    for (int64_t i = 0; i < n; ++i) {
      if (bwd_order_.size() != static_cast<size_t>(n) || bwd_order_[i] != n - 1 - i) {
        throw std::runtime_error("layer timing: backward crossed the layer boundaries out of order");
      }
    }
  }
  std::vector<LayerTime> out;
  for (int64_t k = 0; k <= n; ++k) {
    LayerTime lt;
    lt.name = k < n ? boundaries_[k] : std::string("lm_head");
    const int64_t f0 = k == 0 ? fwd_begin_ : fwd_marks_[k - 1];
    const int64_t f1 = k < n ? fwd_marks_[k] : fwd_end_;
    lt.fwd_ms = timer_->elapsed_ms(f0, f1);
    if (have_bwd) {
      // The gradient reaches a segment's output marker first and leaves through its input marker.
      lt.bwd_ms = k < n ? timer_->elapsed_ms(bwd_marks_[k], k == 0 ? bwd_end_ : bwd_marks_[k - 1])
                        : timer_->elapsed_ms(bwd_begin_, bwd_marks_[n - 1]);
    }
    out.push_back(std::move(lt));
  }
  return out;
}

}  // namespace collider::harness
