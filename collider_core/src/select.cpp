// Token selection (DESIGN.md section 4): the keep mask from per-token scores.
// per_sequence: same kept count N in every row, drop count rounded up to a multiple of align.
// batch_topk: RHO-1's global top-k over the batch (ragged rows, which filter_backward accepts).
// Tests: python/tests/test_api.py (selection, messages), tests/test_collider_ragged.cpp.
#include <collider/select.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace collider {

static void check_ratio(double filter_ratio) {
  if (!(filter_ratio >= 0.0 && filter_ratio < 1.0)) {
    throw std::invalid_argument("filter_ratio " + std::to_string(filter_ratio) +
                                " is outside [0, 1): it is the fraction of tokens dropped");
  }
}

static int64_t drop_count(int64_t n_valid, double filter_ratio, int64_t align) {
  // Exact for ratios like 0.4 despite binary floating point: round before ceil.
  double raw = std::round(filter_ratio * static_cast<double>(n_valid) * 1e6) / 1e6;
  int64_t drop = static_cast<int64_t>(std::ceil(raw));
  if (align > 1 && drop > 0) drop = (drop + align - 1) / align * align;
  return drop;
}

static int64_t kept_count_impl(int64_t T, double filter_ratio, int64_t align) {
  check_ratio(filter_ratio);
  if (align < 1) throw std::invalid_argument("align must be >= 1, got " + std::to_string(align));
  return T - drop_count(T, filter_ratio, align);
}

static torch::Tensor excess_loss_impl(const torch::Tensor& model_loss_BT, const torch::Tensor& reference_loss_BT) {
  TORCH_CHECK(model_loss_BT.sizes() == reference_loss_BT.sizes(),
              "excess_loss: model and reference losses must have the same shape, got ", model_loss_BT.sizes(), " and ",
              reference_loss_BT.sizes());
  return model_loss_BT.detach() - reference_loss_BT.detach().to(model_loss_BT.dtype());
}

static torch::Tensor select_tokens_impl(const torch::Tensor& scores_BT, double filter_ratio,
                                        const SelectOptions& opts) {
  check_ratio(filter_ratio);
  TORCH_CHECK(scores_BT.dim() == 2, "select_tokens: scores must be [B, T], got shape ", scores_BT.sizes());
  const int64_t B = scores_BT.size(0), T = scores_BT.size(1);
  if (B == 0 || T == 0)
    throw std::invalid_argument("select_tokens: empty batch (shape [" + std::to_string(B) + ", " + std::to_string(T) +
                                "])");
  if (opts.align < 1) throw std::invalid_argument("select_tokens: align must be >= 1");
  torch::NoGradGuard no_grad;
  auto scores = scores_BT.detach().to(torch::kFloat64);
  torch::Tensor valid = opts.valid_BT ? opts.valid_BT->to(scores.device()).to(torch::kBool)
                                      : torch::ones({B, T}, scores.options().dtype(torch::kBool));
  TORCH_CHECK(valid.sizes() == scores.sizes(), "select_tokens: valid mask shape ", valid.sizes(),
              " does not match scores ", scores.sizes());
  TORCH_CHECK(!scores.masked_select(valid).isnan().any().item<bool>(), "select_tokens: NaN score at a valid position");
  // Invalid positions sort last. Deterministic ties: stable sort descending keeps earlier first.
  auto keyed = scores.masked_fill(~valid, -std::numeric_limits<double>::infinity());

  auto keep = torch::zeros({B, T}, scores.options().dtype(torch::kBool));
  if (opts.policy == SelectPolicy::kPerSequence) {
    auto n_valid = valid.sum(1);  // [B]
    const int64_t nv0 = n_valid[0].item<int64_t>();
    if (!(n_valid == nv0).all().item<bool>()) {
      auto counts = n_valid.to(torch::kCPU).contiguous();
      const auto* c = counts.data_ptr<int64_t>();
      throw std::invalid_argument(fmt::format(
          "select_tokens(per_sequence): every row needs the same number of labelled positions to keep the same "
          "count, and these rows have [{}] (padded rows?). Use policy=\"batch_topk\": rows then keep different "
          "counts, which filter_backward accepts",
          fmt::format("{}", fmt::join(c, c + std::min<int64_t>(B, 16), ", ")) + (B > 16 ? ", ..." : "")));
    }
    const int64_t N = nv0 - drop_count(nv0, filter_ratio, opts.align);
    if (N <= 0) {
      throw std::invalid_argument("select_tokens: filter_ratio " + std::to_string(filter_ratio) + " with align " +
                                  std::to_string(opts.align) + " keeps no token of " + std::to_string(nv0) +
                                  " labelled positions per row; lower the ratio or the alignment");
    }
    auto order = std::get<1>(keyed.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));  // [B, T]
    keep.scatter_(1, order.narrow(1, 0, N), true);
  } else {
    const int64_t nv = valid.sum().item<int64_t>();
    const int64_t N = nv - drop_count(nv, filter_ratio, 1);
    if (N <= 0) throw std::invalid_argument("select_tokens(batch_topk): the ratio keeps no token");
    auto order = std::get<1>(keyed.reshape({-1}).sort(true, 0, true));
    keep.view({-1}).index_fill_(0, order.narrow(0, 0, N), true);
  }
  return keep.logical_and_(valid);
}

// The public entry points: every failure leaves as collider::Error (c10::Error's backtrace cut).
template <typename Fn>
static auto as_collider_error(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error&) { throw; } catch (const std::exception& e) {
    std::string what = e.what();
    throw Error(what.substr(0, what.find('\n')));
  }
}

int64_t kept_count(int64_t T, double filter_ratio, int64_t align) {
  return as_collider_error([&] { return kept_count_impl(T, filter_ratio, align); });
}

torch::Tensor excess_loss(const torch::Tensor& model_loss_BT, const torch::Tensor& reference_loss_BT) {
  return as_collider_error([&] { return excess_loss_impl(model_loss_BT, reference_loss_BT); });
}

torch::Tensor select_tokens(const torch::Tensor& scores_BT, double filter_ratio, const SelectOptions& opts) {
  return as_collider_error([&] { return select_tokens_impl(scores_BT, filter_ratio, opts); });
}

}  // namespace collider
