// Consumer of the installed collider package: a two-layer token-wise model, the one added line,
// and a check that the filtered gradient equals the masked loss's gradient (token-wise ops only).
#include <collider/collider.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  auto w1 = torch::randn({16, 32}, torch::requires_grad());
  auto w2 = torch::randn({32, 1}, torch::requires_grad());
  auto loss_of = [&](const torch::Tensor& x_BTD, const torch::Tensor& keep_BT) {
    auto per_token = torch::tanh(x_BTD.matmul(w1)).matmul(w2).squeeze(-1).pow(2);  // [B, T]
    auto keep = keep_BT.to(torch::kFloat);
    return (per_token * keep).sum() / keep.sum();
  };
  collider::Plan plan = collider::trace_plan([&](int64_t B, int64_t T) {
    return loss_of(torch::randn({B, T, 16}), torch::ones({B, T}, torch::kBool));
  });
  auto x = torch::randn({2, 40, 16});
  auto keep = collider::select_tokens(torch::rand({2, 40}), 0.5);
  loss_of(x, keep).backward();
  auto reference = w1.grad().clone();
  w1.mutable_grad().zero_();
  auto loss = loss_of(x, keep);
  collider::FilterStats st = collider::filter_backward(loss, keep, plan);
  loss.backward();
  const double diff = (w1.grad() - reference).abs().max().item<double>();
  std::printf("consumer: %ld tensors gathered, max |grad diff| %.3g\n", static_cast<long>(st.tensors_gathered), diff);
  return diff < 1e-5 && st.tensors_gathered > 0 ? 0 : 1;
}
