// Saved tensors cut when the backward unpacks them (see saved_cut.h).
#include "saved_cut.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <utility>

namespace collider::detail {

using torch::autograd::SavedVariable;

SavedCut::SavedCut(torch::Tensor source, CutFn cut)
    : source_(std::move(source)), source_version_(source_._version()), cut_(std::move(cut)) {}

SavedCut::SavedCut(WeakNodePtr owner, std::shared_ptr<SavedVariable> slot, bool keep_original,
                   CutFn cut)
    : hooked_(std::move(slot)), keep_original_(keep_original), owner_(std::move(owner)), cut_(std::move(cut)) {}

torch::Tensor SavedCut::get() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (result_.defined()) return result_;
  torch::Tensor full;
  if (hooked_) {
    // The hooks' unpack: a recomputation (checkpointing), a copy back (offloading), ... For a
    // tensor the node saved as its own output, unpack needs the node itself.
    full = hooked_->unpack(owner_.lock());
    if (!keep_original_) hooked_->reset_data();  // the hooks' packed state (a checkpoint holder, a CPU copy) goes now
  } else {
    TORCH_CHECK(source_.defined(),
                "collider: a saved tensor was released before its cut was made (backward through a "
                "filtered graph twice?)");
    TORCH_CHECK(source_._version() == source_version_,
                "collider: a tensor saved for the backward was modified in place after filter_backward "
                "(version ", source_version_, " -> ", source_._version(),
                "); call filter_backward right before loss.backward()");
    full = std::move(source_);
  }
  TORCH_CHECK(full.defined(), "collider: a saved tensor's unpack hook returned nothing");
  torch::NoGradGuard no_grad;
  result_ = cut_(full.detach());
  return result_;
}

namespace {

class CutOnUnpack final : public torch::autograd::SavedVariableHooks {
 public:
  CutOnUnpack(std::shared_ptr<SavedCut> cut, std::vector<int64_t> view) : cut_(std::move(cut)), view_(std::move(view)) {}
  void call_pack_hook(const at::Tensor&) override {}  // the placeholder of saved_cut_variable
  at::Tensor call_unpack_hook() override {
    torch::Tensor t = cut_->get();
    return view_.empty() ? t : t.view(view_);
  }

 private:
  std::shared_ptr<SavedCut> cut_;
  std::vector<int64_t> view_;
};

// While alive, a new SavedVariable gets no hooks from an enclosing saved_tensors_hooks context
// (which would pack the placeholder and refuse the hooks registered after it).
class DefaultHooksOff {
 public:
  DefaultHooksOff() : was_enabled_(at::SavedTensorDefaultHooks::is_enabled()) {
    if (was_enabled_) at::SavedTensorDefaultHooks::disable("collider: building a cut saved tensor", false);
  }
  ~DefaultHooksOff() {
    if (was_enabled_) at::SavedTensorDefaultHooks::enable();
  }
  DefaultHooksOff(const DefaultHooksOff&) = delete;
  DefaultHooksOff& operator=(const DefaultHooksOff&) = delete;

 private:
  bool was_enabled_;
};

}  // namespace

SavedVariable saved_cut_variable(std::shared_ptr<SavedCut> cut, std::vector<int64_t> view) {
  DefaultHooksOff off;
  // No data (a meta tensor allocates nothing), only for SavedVariable's bookkeeping; the hooks below
  // ignore it.
  SavedVariable v(torch::empty({0}, torch::TensorOptions().device(torch::kMeta)), /*is_output=*/false);
  v.register_hooks(std::make_unique<CutOnUnpack>(std::move(cut), std::move(view)));
  return v;
}

}  // namespace collider::detail
