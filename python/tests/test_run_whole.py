"""What cannot be cut row by row runs whole (DESIGN.md section 3): the gradient on its kept rows put back
full-size, its backward at full size, its token-shaped inputs' gradients cut back to the kept rows, i.e. the
dropped rows detached at its inputs. Checked against an oracle written here: plain autograd with
`torch.where(keep, x, x.detach())` at the inputs of every op that mixes positions and of every custom
autograd Function (a no-op on a Function that does act row by row: no gradient reaches a dropped row there).

- A toy hybrid block (HybridLM): a causal short convolution along the tokens (padded, then sliced back to T,
  as Mamba's is), a cumulative-sum scan with a learned decay, and an MLP.
- A gated delta rule's pattern (GatedNormLM): a scan over the tokens (run whole) whose [B, T, heads, D] output
  is flattened to [B*T*heads, D] rows for a per-head gated RMSNorm (cut: heads rows per position, in the
  order (b*T + t)*heads + h, DESIGN.md section 3), as Qwen3.5, Qwen3-Next and OLMo hybrid do.
- The fused Functions people load from kernel libraries, written here in plain torch with their own backward
  (FunctionLM): an RMSNorm whose weight gradient sums over rows, a RoPE, an attention (softmax(QK^T)V with a
  causal mask, one Function for the whole of it) and a fused linear cross-entropy as the loss.
float64; B = 3 and 1, T = 37, filter ratios 0.25 and 0.5, per_sequence and ragged (batch_topk) masks, both
semantics (they agree at a node run whole), filter_backward and mask_backward; and again with batch, sequence
and hidden sizes equal (16).
  pytest python/tests/test_run_whole.py
"""
import pytest
import torch
import torch.nn.functional as F

import collider

V = 53


def detach_dropped(x, keep):
    """x [B, T, ...] or [B*T, ...]: the dropped rows detached (the oracle's rule at a node run whole)."""
    if keep is None:
        return x
    k = keep.reshape(-1) if x.shape[0] == keep.numel() and x.shape[0] != keep.shape[0] else keep
    return torch.where(k.view(*k.shape, *[1] * (x.dim() - k.dim())), x, x.detach())


def parameters(seed):
    """A maker of float64 parameters of a given shape, N(0, 0.3^2), from one generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3)


class HybridLM(torch.nn.Module):
    """Embedding -> short convolution along the tokens -> scan (cumulative sum with a decay) -> MLP -> head."""

    def __init__(self, hidden):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        H = hidden
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3)
        self.conv = torch.nn.Parameter(torch.randn(H, 1, 4, generator=g, dtype=torch.float64) * 0.3)
        self.decay = torch.nn.Parameter(torch.rand(H, generator=g, dtype=torch.float64))
        self.w_in = torch.nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) * 0.3)
        self.w_out = torch.nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) * 0.3)
        self.head = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3)
        self.oracle_keep = None

    def forward(self, ids):  # ids [B, T] -> logits [B, T, V]
        T = ids.shape[1]
        keep = self.oracle_keep
        h = self.emb[ids]  # [B, T, H]
        x = detach_dropped(h, keep).transpose(1, 2)  # [B, H, T]
        h = h + F.conv1d(x, self.conv, padding=3, groups=x.shape[1])[..., :T].transpose(1, 2)
        u = torch.sigmoid(self.decay) * (h @ self.w_in)  # [B, T, H]
        h = h + torch.cumsum(detach_dropped(u, keep), dim=1) / T
        h = h + torch.tanh(h @ self.w_out)
        return h @ self.head.T


class GatedNormLM(torch.nn.Module):
    """Embedding -> per-head scan (cumulative sum with a decay) -> [B*T*heads, D] gated RMSNorm -> head."""

    def __init__(self, hidden, heads=2):
        super().__init__()
        H, p = hidden, parameters(seed=2)
        self.heads = heads
        self.emb, self.w_in, self.w_gate, self.w_out, self.head = p(V, H), p(H, H), p(H, H), p(H, H), p(V, H)
        self.norm = torch.nn.Parameter(1 + p(H // heads).detach() / 3)
        self.oracle_keep = None

    def forward(self, ids):  # ids [B, T] -> logits [B, T, V]
        B, T = ids.shape
        h = self.emb[ids]  # [B, T, H]
        u = (h @ self.w_in).view(B, T, self.heads, -1)  # [B, T, heads, D]
        s = torch.cumsum(detach_dropped(u, self.oracle_keep), dim=1) / T  # the scan, along the tokens
        gate = (h @ self.w_gate).view(B, T, self.heads, -1)
        x = s.reshape(-1, s.shape[-1])  # [B*T*heads, D]: heads rows per position
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm * F.silu(gate.reshape(x.shape))
        h = h + x.view(B, T, -1) @ self.w_out
        return h @ self.head.T


class RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w; its weight gradient sums over every row."""

    @staticmethod
    def forward(ctx, x, w):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, w, r)
        return x * r * w

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        n = x * r
        gn = g * w
        gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx, (g * n).reshape(-1, w.shape[0]).sum(0)


class RoPEFn(torch.autograd.Function):
    """Rotary position embedding of x [B, T, H, D] at positions 0..T-1, the rotation undone in its backward."""

    @staticmethod
    def angles(T, D, dtype):
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=dtype) / D))
        a = torch.arange(T, dtype=dtype)[:, None] * inv  # [T, D/2]
        return a.cos()[None, :, None], a.sin()[None, :, None]  # [1, T, 1, D/2]

    @staticmethod
    def rotate(x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        cos, sin = RoPEFn.angles(x.shape[1], x.shape[-1], x.dtype)
        return RoPEFn.rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = RoPEFn.angles(ctx.shape[1], ctx.shape[-1], g.dtype)
        return RoPEFn.rotate(g, cos, -sin)


class AttentionFn(torch.autograd.Function):
    """Causal softmax(Q K^T / sqrt(D)) V over q, k, v [B, H, T, D] in one Function (a FlashAttention-style kernel)."""

    @staticmethod
    def forward(ctx, q, k, v):
        T = q.shape[2]
        s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        p = torch.softmax(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")), -1)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved_tensors
        dv = p.transpose(-2, -1) @ g
        dp = g @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / q.shape[-1] ** 0.5
        return ds @ k, ds.transpose(-2, -1) @ q, dv


class LinearCrossEntropyFn(torch.autograd.Function):
    """sum over rows of w_r * cross_entropy(h W^T, target): hidden h [N, D], weight W [V, D], row weights w [N]."""

    @staticmethod
    def forward(ctx, h, W, target, w):
        logits = h @ W.T
        lse = torch.logsumexp(logits, -1)
        ctx.save_for_backward(h, W, target, w, logits, lse)
        return (w * (lse - logits.gather(1, target[:, None])[:, 0])).sum()

    @staticmethod
    def backward(ctx, g):
        h, W, target, w, logits, lse = ctx.saved_tensors
        d = torch.softmax(logits, -1)
        d[torch.arange(d.shape[0]), target] -= 1
        d = d * (g * w)[:, None]
        return d @ W, d.T @ h, None, None


class FunctionLM(torch.nn.Module):
    """Embedding -> RMSNorm -> attention (RoPE on q and k) -> residual -> RMSNorm -> loss, every one a Function."""

    def __init__(self, hidden, heads=2):
        super().__init__()
        H, p = hidden, parameters(seed=1)
        self.heads = heads
        self.emb, self.norm1, self.norm2 = p(V, H), torch.nn.Parameter(torch.ones(H, dtype=torch.float64)), \
            torch.nn.Parameter(torch.ones(H, dtype=torch.float64))
        self.wq, self.wk, self.wv, self.wo, self.head = p(H, H), p(H, H), p(H, H), p(H, H), p(V, H)
        self.oracle_keep = None

    def loss(self, ids, keep):  # the masked mean of the next-token losses over kept positions
        B, T = ids.shape
        o = self.oracle_keep
        h = self.emb[ids]  # [B, T, H]
        x = RMSNormFn.apply(detach_dropped(h, o), self.norm1)
        split = lambda t: t.view(B, T, self.heads, -1)  # [B, T, heads, D]
        q = RoPEFn.apply(detach_dropped(split(x @ self.wq), o)).transpose(1, 2)
        k = RoPEFn.apply(detach_dropped(split(x @ self.wk), o)).transpose(1, 2)
        v = split(x @ self.wv).transpose(1, 2)
        q, k, v = (detach_dropped(t.transpose(1, 2), o).transpose(1, 2) for t in (q, k, v))
        a = AttentionFn.apply(q, k, v)  # [B, heads, T, D]
        h = h + a.transpose(1, 2).reshape(B, T, -1) @ self.wo
        x = RMSNormFn.apply(detach_dropped(h, o), self.norm2).reshape(B * T, -1)
        w = keep.reshape(-1).to(x.dtype) / keep.sum()
        return LinearCrossEntropyFn.apply(detach_dropped(x, o), self.head, torch.roll(ids, -1, 1).reshape(-1), w)


def hybrid_loss(model, ids, keep):
    logits = model(ids)
    targets = torch.where(keep, torch.roll(ids, -1, 1), torch.full_like(ids, -100))
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum") / keep.sum()


MODELS = {"hybrid": (HybridLM, hybrid_loss), "gated_norm": (GatedNormLM, hybrid_loss), "functions": (FunctionLM, lambda m, ids, keep: m.loss(ids, keep))}


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel(a, b):
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def keep_masks(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    masks = {f"per_sequence {r}": collider.select_tokens(torch.rand(B, T, generator=g), r) for r in (0.25, 0.5)}
    if B > 1:
        scores = torch.rand(B, T, generator=g)
        scores[1] += 0.3  # row 1 keeps more: ragged kept counts
        masks["batch_topk 0.5"] = collider.select_tokens(scores, 0.5, policy="batch_topk")
    return ids, masks


@pytest.mark.parametrize("B,T,hidden", [(3, 37, 8), (1, 37, 8), (16, 16, 16)], ids=["B3", "B1", "equal-sizes"])
@pytest.mark.parametrize("name", list(MODELS))
def test_run_whole_matches_the_oracle(name, B, T, hidden):
    cls, loss_fn = MODELS[name]
    model = cls(hidden)
    plan = collider.trace_plan(lambda b, t: loss_fn(model, torch.randint(0, V, (b, t)),
                                                    torch.ones(b, t, dtype=torch.bool)))
    kinds = [line.split()[3] for line in plan.to_string().splitlines() if line.startswith("node ")]
    assert "4" in kinds, plan.to_string()  # a node run whole, in the plan's text form
    if name == "gated_norm":  # the norm's rows are cut, heads per position (dimension kind 10 of the plan text)
        assert ":10:0:2" in plan.to_string(), plan.to_string()
    ids, masks = keep_masks(B, T, seed=B + T)
    for mask_name, keep in masks.items():
        model.zero_grad()
        model.oracle_keep = keep
        loss_fn(model, ids, keep).backward()
        model.oracle_keep = None
        oracle = grads(model)
        for attention in ("kept_only", "exact_query"):
            for rewrite in (collider.filter_backward, collider.mask_backward):
                model.zero_grad()
                loss = loss_fn(model, ids, keep)
                stats = rewrite(loss, keep, plan, attention=attention)
                loss.backward()
                where = (name, mask_name, attention, rewrite.__name__)
                assert max_rel(grads(model), oracle) < 1e-10, where
                assert stats.nodes_run_whole >= 1, (where, stats)


def test_a_plain_backward_after_filtering_is_not_needed_twice():
    """A node run whole keeps its own saved tensors: the backward runs once and frees them, as a plain one does."""
    model = HybridLM(8)
    plan = collider.trace_plan(lambda b, t: hybrid_loss(model, torch.randint(0, V, (b, t)),
                                                        torch.ones(b, t, dtype=torch.bool)))
    ids, masks = keep_masks(3, 37, seed=2)
    loss = hybrid_loss(model, ids, masks["per_sequence 0.5"])
    collider.filter_backward(loss, masks["per_sequence 0.5"], plan)
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
