"""Operations no model family of the other tests has, which collider once cut as if they were
row-wise: each is now exact, run whole, or a typed refusal (collider.Error, nothing touched), never a
silent wrong gradient and never a crashed backward (collider_core/src/row_rules.h: a node is cut along
a token dimension only under a rule that says it acts row by row there; any other runs whole, its
dropped rows detached at its inputs, DESIGN.md section 3).

- Expert-major copies of the token rows (Llama 4's mixture of experts): `h.repeat(E, 1)` scaled by
  the router's transposed scores and run through one batched matmul per expert. The repeat puts the
  copies outermost ([E, B*T] rows), which no layout of the plan describes: refused.
- An FFT along the sequence (FNet): `h + fftn(h, dim=(1, 2)).real` mixes every position: run whole.
- A fused attention over positions that are not the tokens (a vision tower's image patches, here a
  fixed memory of P slots) whose pooled output is added to every token: left whole, exact.
- A linear attention (phi(K)^T V summed over the sequence) and a reduction over the tokens whose
  result flows back into every token: run whole; the same reduction as the loss's own: exact.
What runs whole is checked against an oracle written here (PatternLM.oracle_keep): plain autograd with
the dropped rows detached at the inputs of the op that mixes positions.
float64, B = 3, T = 37 (B = 1 too), filter ratios 0.25 and 0.5, both semantics; a refusal leaves
the graph as it was (a plain backward afterwards gives the loss_only gradient).
  pytest python/tests/test_unseen_ops.py
"""
import pytest
import torch
import torch.nn.functional as F

import collider

V, D, E, P = 61, 16, 4, 5  # vocabulary, width, experts, fixed memory slots
T = 37


class PatternLM(torch.nn.Module):
    """Embedding -> one pattern block (residual) -> head; the block is what each test is about."""

    def __init__(self, block: str):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        p = lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3)
        self.block = block
        self.oracle_keep = None  # bool [B, T]: the oracle's forward, dropped rows detached where positions mix
        self.emb = p(V, D)
        self.router = p(E, D)
        self.experts = p(E, D, D)
        self.memory = p(P, D)
        self.wq, self.wk, self.wv = p(D, D), p(D, D), p(D, D)
        self.head = p(V, D)

    def whole(self, x):  # x [B, T, ...] at the input of an op that mixes positions (the oracle's rule)
        keep = self.oracle_keep
        return x if keep is None else torch.where(keep.view(*keep.shape, *[1] * (x.dim() - 2)), x, x.detach())

    def forward(self, ids):  # ids [B, T] -> logits [B, T, V]
        B, T = ids.shape
        h = self.emb[ids]  # [B, T, D]
        if self.block == "expert_major_moe":  # Llama 4's experts: every expert on copies of every row
            x = h.reshape(-1, D)  # [B*T, D]
            scores = torch.sigmoid(x @ self.router.T)  # [B*T, E]
            routed = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)  # [E*B*T, D], expert-major
            out = torch.bmm(routed.view(E, -1, D), self.experts).sum(0)  # [B*T, D]
            h = h + out.view(B, T, D)
        elif self.block == "fft":  # FNet's token mixing
            h = h + torch.fft.fftn(self.whole(h), dim=(1, 2)).real
        elif self.block == "memory_sdpa":  # attention over P fixed slots, pooled, added to every token
            mem = self.memory.expand(B, P, D)  # [B, P, D], like a vision tower's patches of B images
            att = F.scaled_dot_product_attention(
                (mem @ self.wq)[:, None], (mem @ self.wk)[:, None], (mem @ self.wv)[:, None])  # [B, 1, P, D]
            h = h + att.mean(2)  # [B, 1, D] broadcast over the tokens
        elif self.block == "linear_attention":  # phi(K)^T V over the whole sequence
            k = F.elu(h @ self.wk) + 1
            state = self.whole(k).transpose(1, 2) @ self.whole(h @ self.wv)  # [B, D, D]
            h = h + (F.elu(h @ self.wq) + 1) @ state
        elif self.block == "pooled":  # a mean over the tokens added back to every token
            h = h + self.whole(h).mean(1, keepdim=True) @ self.wq
        return h @ self.head.T


def masked_loss(model, ids, keep):  # the masked per-token loss, summed over kept positions / count
    logits = model(ids)
    targets = torch.where(keep, ids, torch.full_like(ids, -100))
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum") / keep.sum().clamp(min=1)


def plan_for(model):
    return collider.trace_plan(lambda b, t: masked_loss(model, torch.randint(0, V, (b, t)),
                                                        torch.ones(b, t, dtype=torch.bool)))


def grads_of(model, ids, keep, how, attention="kept_only", plan=None):
    model.zero_grad(set_to_none=True)
    loss = masked_loss(model, ids, keep)
    if how == "filter":
        collider.filter_backward(loss, keep, plan, attention=attention)
    elif how == "mask":
        collider.mask_backward(loss, keep, plan, attention=attention)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batch(B, ratio, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, collider.select_tokens(torch.rand(B, T, generator=g), ratio)


def max_rel(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


@pytest.mark.parametrize("block", ["expert_major_moe"])
def test_cut_that_would_be_wrong_is_refused_and_a_plain_backward_still_works(block):
    model = PatternLM(block)
    with pytest.raises(collider.Error, match="collider cannot rewrite node") as refused:
        plan_for(model)
    assert len(str(refused.value)) < 400, str(refused.value)
    ids, keep = batch(3, 0.5, seed=1)
    plain = grads_of(model, ids, keep, "plain")
    assert plain and all(torch.isfinite(g).all() for g in plain.values())


def test_expert_major_moe_is_refused_at_the_repeat():
    with pytest.raises(collider.Error, match="RepeatBackward0.*repeats dimension 0 of its input, a token dimension"):
        plan_for(PatternLM("expert_major_moe"))


def oracle_grads(model, ids, keep):
    """Plain autograd with the dropped rows detached at the inputs of the ops that mix positions."""
    model.oracle_keep = keep
    try:
        return grads_of(model, ids, keep, "plain")
    finally:
        model.oracle_keep = None


@pytest.mark.parametrize("block", ["fft", "linear_attention", "pooled"])
def test_an_op_that_mixes_positions_runs_whole_and_matches_the_oracle(block):
    """The FFT along the sequence, the linear attention's sum over it and the mean over it: each node runs
    whole (FilterStats.nodes_run_whole), and both rewrites give the oracle's gradients, both semantics (they
    agree at such a node), B = 3 and 1, filter ratios 0.25 and 0.5, per_sequence and ragged masks."""
    model = PatternLM(block)
    plan = plan_for(model)
    for B, ratio, policy in ((3, 0.25, "per_sequence"), (3, 0.5, "per_sequence"), (1, 0.5, "per_sequence"),
                             (3, 0.5, "batch_topk")):
        g = torch.Generator().manual_seed(B * 10 + int(ratio * 4))
        ids = torch.randint(0, V, (B, T), generator=g)
        scores = torch.rand(B, T, generator=g)
        if B > 1:
            scores[1] += 0.3  # ragged under batch_topk: row 1 keeps more
        keep = collider.select_tokens(scores, ratio, policy=policy)
        if block == "fft" and policy == "batch_topk":  # complex gradients under ragged counts: refused for now
            loss = masked_loss(model, ids, keep)
            with pytest.raises(collider.Error, match="complex gradient at its border"):
                collider.filter_backward(loss, keep, plan)
            continue
        ref = oracle_grads(model, ids, keep)
        for attention in ("kept_only", "exact_query"):
            for how in ("filter", "mask"):
                got = grads_of(model, ids, keep, how, attention, plan)
                assert max_rel(got, ref) < 1e-10, (block, B, ratio, policy, attention, how)
    ids, keep = batch(3, 0.5, seed=1)
    model.zero_grad()
    loss = masked_loss(model, ids, keep)
    stats = collider.filter_backward(loss, keep, plan)
    assert stats.nodes_run_whole >= 1, stats


def test_fft_along_features_only_is_row_wise_and_exact():
    class FeatureFFT(PatternLM):
        def forward(self, ids):
            h = self.emb[ids]
            h = h + torch.fft.fft(h, dim=-1).real  # mixes features, never positions
            return h @ self.head.T

    model = FeatureFFT("none")
    plan = plan_for(model)
    for attention in ("kept_only", "exact_query"):
        for B, ratio in ((3, 0.25), (3, 0.5), (1, 0.5)):
            ids, keep = batch(B, ratio, seed=B * 10 + int(ratio * 4))
            got = grads_of(model, ids, keep, "filter", attention, plan)
            assert max_rel(got, grads_of(model, ids, keep, "mask", attention, plan)) < 1e-10


def test_fused_attention_over_fixed_slots_is_left_whole_and_exact():
    model = PatternLM("memory_sdpa")
    plan = plan_for(model)
    for attention in ("kept_only", "exact_query"):
        for B, ratio in ((3, 0.25), (3, 0.5), (1, 0.5)):
            ids, keep = batch(B, ratio, seed=B * 10 + int(ratio * 4))
            got = grads_of(model, ids, keep, "filter", attention, plan)  # the backward runs: no crash
            ref = grads_of(model, ids, keep, "mask", attention, plan)
            assert max_rel(got, ref) < 1e-10, (attention, B, ratio)
            assert got["memory"].abs().max() > 0  # the slots' own parameters get their gradient


def test_mean_over_tokens_as_the_loss_is_exact():
    class MeanLoss(PatternLM):  # the loss's own reduction over the tokens: (token loss * keep).mean()
        pass

    model = MeanLoss("none")

    def loss_of(ids, keep):
        tok = F.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1), reduction="none").view(ids.shape)
        return (tok * keep).mean()

    plan = collider.trace_plan(lambda b, t: loss_of(torch.randint(0, V, (b, t)), torch.ones(b, t, dtype=torch.bool)))
    ids, keep = batch(3, 0.5, seed=4)
    out = {}
    for how in ("filter", "mask"):
        model.zero_grad(set_to_none=True)
        loss = loss_of(ids, keep)
        (collider.filter_backward if how == "filter" else collider.mask_backward)(loss, keep, plan)
        loss.backward()
        out[how] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert max_rel(out["filter"], out["mask"]) < 1e-10


def test_every_generated_node_type_has_a_rule():
    rules = collider.row_rules()
    assert len(rules) > 500
    kinds = {r for _, r, _ in rules}
    assert kinds <= {"pointwise", "layout", "along dim", "reduction", "norm", "matmul", "repeat", "lookup",
                     "attention", "refused"}
    by_type = {t: r for t, r, _ in rules}
    assert by_type["MulBackward0"] == "pointwise" and by_type["FftR2CBackward0"] == "along dim"
    assert by_type["ConvolutionBackward0"] == "refused" and by_type["RepeatBackward0"] == "repeat"
    assert all(reason for _, _, reason in rules)
