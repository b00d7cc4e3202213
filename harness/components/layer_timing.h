// Per-layer forward and backward times from marker autograd functions at the model's layer
// boundaries (models::CausalLM::set_boundary_hook). A marker's forward records a timestamp
// when the hidden states cross a boundary; its backward records one when the gradient passes
// back through it, on the plain and on the Collider-rewritten graph alike (the marker node is
// registered with collider::register_passthrough_node: it maps gradient rows one to one and
// saves nothing token-shaped). Segments between consecutive marks give, in model order:
//   embedding, layer.00 .. layer.NN, final_norm, lm_head (LM head + per-token loss)
// in forward, and the same names in backward (lm_head first). Each segment is also an NVTX /
// trace range named <name>.fwd / <name>.bwd.
// Tests: tests/test_layer_timing_slow.cpp, tests/test_train_step.cpp.
#pragma once

#include "harness/components/ranges.h"
#include "harness/components/timer.h"
#include "models/model.h"

#include <mutex>
#include <string>
#include <vector>

namespace collider::harness {

struct LayerTime {
  std::string name;
  double fwd_ms = 0.0;
  double bwd_ms = 0.0;
};

class LayerTimer {
 public:
  // timer and ranges must outlive this object; ranges may be null.
  LayerTimer(Timer* timer, RangeRecorder* ranges);
  ~LayerTimer();

  // Installs the boundary hook on `model` (replacing any other hook).
  void install(models::CausalLM& model);
  // While false, markers stay in the graph (so traced plans match) but record nothing.
  void set_recording(bool on) { recording_ = on; }
  bool recording() const { return recording_; }

  // Called by the training step around forward (model + per-token loss) and backward.
  void forward_begin();
  void forward_end();
  void backward_begin();
  void backward_end();

  // After the timer has synchronized: per-segment times of the last step, in model order.
  // Throws collider::Error-like std::runtime_error when a marker did not fire or fired out of
  // order (what a graph rewrite that dropped a marker would cause).
  std::vector<LayerTime> resolve() const;

  // Boundary names seen in forward and in backward, in the order they fired (tests).
  std::vector<std::string> forward_order() const;
  std::vector<std::string> backward_order() const;

  // Called from the marker autograd function.
  void on_marker_forward(int64_t boundary);
  void on_marker_backward(int64_t boundary);

  // Name of the marker's autograd node (what register_passthrough_node receives).
  static std::string marker_node_name();

 private:
  int64_t boundary_index(const std::string& name);
  std::string segment_after(int64_t boundary) const;   // forward segment that starts at boundary
  std::string segment_before(int64_t boundary) const;  // segment that ends at boundary

  Timer* timer_;
  RangeRecorder* ranges_;
  bool recording_ = true;
  mutable std::mutex mu_;
  std::vector<std::string> boundaries_;  // "embedding", "layer.00", ..., "final_norm"
  // Marks of the current step: forward_begin, each boundary forward, forward_end; the same in
  // backward. -1 = did not fire.
  int64_t fwd_begin_ = -1, fwd_end_ = -1, bwd_begin_ = -1, bwd_end_ = -1;
  std::vector<int64_t> fwd_marks_, bwd_marks_;
  std::vector<int64_t> fwd_order_, bwd_order_;
  uint64_t open_range_ = 0;
};

}  // namespace collider::harness
