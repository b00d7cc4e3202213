"""The collider Python API itself (DESIGN.md section 4b): names, argument checks, error translation,
Plan serialisation, the trace callable's exceptions, all-or-nothing refusals, custom autograd
Functions, torch.compile refusal and transformers' use_cache default.
  pytest python/tests/test_api.py
"""
import pickle

import pytest
import torch

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, oracle_keep, tiny_model


class TinyLM(torch.nn.Module):
    """Embedding -> causal single-head attention -> MLP -> head, written here (no transformers)."""

    def __init__(self, vocab=64, dim=16, custom=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab)
        self.custom = custom
        self.oracle_keep = None  # bool [B, T]: an exact_query oracle's forward (dropped rows detached below)

    def detach_dropped(self, x):  # x [B, T, D]
        keep = self.oracle_keep
        return x if keep is None else torch.where(keep[..., None], x, x.detach())

    def forward(self, ids):
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k, v = self.detach_dropped(k), self.detach_dropped(v)
        s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        T = ids.shape[1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        x = x + torch.softmax(s, -1) @ v
        if self.custom is not None:
            x = self.custom.apply(self.detach_dropped(x))
        x = x + self.mlp(x)
        return self.head(x)


def tiny_loss(model, ids, keep):
    logits = model(ids)
    tok = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape)
    return chf.masked_mean(tok, keep)


def tiny_plan(model):
    return collider.trace_plan(lambda b, t: tiny_loss(model, torch.randint(0, 64, (b, t)), torch.ones(b, t, dtype=torch.bool)))


def keep_mask(batch, seq_len, ratio=0.5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return collider.select_tokens(torch.rand(batch, seq_len, generator=gen), ratio)


def test_public_names():
    for name in ("Error", "Plan", "FilterStats", "trace_plan", "filter_backward", "mask_backward", "select_tokens",
                 "register_passthrough_node"):
        assert hasattr(collider, name), name
    assert issubclass(collider.Error, RuntimeError)
    assert collider.Error.__module__ == "collider" and collider.Plan.__module__ == "collider"
    assert collider._C.TORCH_VERSION_BUILT == torch.__version__.split("+")[0]


def test_select_tokens_per_sequence_and_batch_topk():
    scores = torch.rand(3, 37, generator=torch.Generator().manual_seed(0))
    keep = collider.select_tokens(scores, 0.4)
    assert keep.dtype == torch.bool and keep.shape == (3, 37)
    n = collider.kept_count(37, 0.4)  # drop 15 -> rounded up to 16
    assert n == 21 and bool((keep.sum(1) == n).all())
    # the kept positions are the highest scores of each row
    for b in range(3):
        assert scores[b][keep[b]].min() >= scores[b][~keep[b]].max()
    keep = collider.select_tokens(scores, 0.4, policy="batch_topk")
    assert int(keep.sum()) == 3 * 37 - round(0.4 * 3 * 37 + 0.5)
    valid = torch.ones(3, 37, dtype=torch.bool)
    valid[:, -1] = False
    keep = collider.select_tokens(scores, 0.25, valid=valid, align=1)
    assert not bool(keep[:, -1].any()) and bool((keep.sum(1) == 36 - 9).all())


@pytest.mark.parametrize("call, words", [
    (lambda: collider.select_tokens(torch.rand(2, 8), 1.0), "outside [0, 1)"),
    (lambda: collider.select_tokens(torch.rand(2, 8), 0.5, policy="top"), "policy must be one of"),
    (lambda: collider.select_tokens(torch.rand(8), 0.5), "[B, T]"),
    (lambda: collider.select_tokens([[1.0]], 0.5), "torch.Tensor"),
    (lambda: collider.select_tokens(torch.tensor([[1.0, float("nan")]]), 0.0, align=1), "NaN"),  # a TORCH_CHECK in C++
    (lambda: collider.select_tokens(torch.rand(2, 8), 0.25, align=1, valid=torch.tensor([[True] * 8, [False] + [True] * 7])),
     "same number"),
    (lambda: collider.kept_count(8, 0.5, align=0), "align"),
    (lambda: collider.register_passthrough_node(""), "non-empty"),
])
def test_refusals_are_collider_errors(call, words):
    with pytest.raises(collider.Error) as e:
        call()
    assert words in str(e.value)


def test_plan_round_trip_and_pickle():
    model = TinyLM()
    plan = tiny_plan(model)
    assert plan.num_nodes > 10 and 0 < plan.num_token_nodes <= plan.num_nodes
    assert "attention" in plan.summary()
    text = plan.to_string()
    again = collider.Plan.from_string(text)
    assert again.to_string() == text and again.summary() == plan.summary()
    assert pickle.loads(pickle.dumps(plan)).to_string() == text
    with pytest.raises(collider.Error):
        collider.Plan.from_string("not a plan")
    assert "Plan" in repr(plan)


def test_trace_callable_exceptions_come_back_clearly():
    def boom(batch, seq_len):
        raise ValueError("no data for this shape")

    with pytest.raises(collider.Error) as e:
        collider.trace_plan(boom)
    assert "loss_on_random_batch(3, 53) raised ValueError: no data for this shape" in str(e.value)
    assert isinstance(e.value.__cause__, ValueError)

    with pytest.raises(collider.Error, match="returned float, not a scalar torch.Tensor"):
        collider.trace_plan(lambda b, t: 1.0)
    with pytest.raises(collider.Error, match="requires grad"):
        collider.trace_plan(lambda b, t: torch.zeros(()))
    with pytest.raises(collider.Error, match="must be callable"):
        collider.trace_plan(42)


def test_filter_backward_argument_checks():
    model = TinyLM()
    plan = tiny_plan(model)
    ids = torch.randint(0, 64, (2, 24))
    keep = keep_mask(2, 24)
    loss = tiny_loss(model, ids, keep)
    with pytest.raises(collider.Error, match="bool tensor"):
        collider.filter_backward(loss, keep.float(), plan)
    with pytest.raises(collider.Error, match="attention must be one of"):
        collider.filter_backward(loss, keep, plan, attention="exact")
    with pytest.raises(collider.Error, match="collider.Plan"):
        collider.filter_backward(loss, keep, plan.to_string())
    with pytest.raises(collider.Error, match="no grad_fn"):
        collider.filter_backward(loss.detach(), keep, plan)
    stats = collider.filter_backward(loss, keep, plan, attention="exact_query")
    assert isinstance(stats, collider.FilterStats)
    d = stats.to_dict()
    assert d["kept"] == collider.kept_count(24, 0.5) == 8 and d["seq_len"] == 24 and d["batch"] == 2 and d["rewrite_ms"] >= 0
    assert d["kept_total"] == 16 and d["kept_min"] == d["kept_max"] == 8
    assert "kept=8" in repr(stats)
    loss.backward()


def test_refusal_leaves_the_graph_unchanged():
    """All or nothing: after a collider.Error a plain backward gives the loss_only gradient."""
    model = TinyLM()
    plan = tiny_plan(model)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    keep = keep_mask(2, 24)
    model.zero_grad()
    tiny_loss(model, ids, keep).backward()
    dense = grads(model)

    # a plan traced for another loss (one more node on top, not a scaling by a constant, which a plan
    # serves): the graph does not match it
    other_plan = collider.trace_plan(
        lambda b, t: tiny_loss(model, torch.randint(0, 64, (b, t)), torch.ones(b, t, dtype=torch.bool)) ** 2)
    for bad_keep, bad_plan in ((keep, other_plan), (keep[:, :20], plan), (keep[:1], plan)):
        model.zero_grad()
        loss = tiny_loss(model, ids, keep)
        with pytest.raises(collider.Error):
            collider.filter_backward(loss, bad_keep, bad_plan)
        loss.backward()
        assert max_rel_diff(grads(model), dense) == 0.0


class Twice(torch.autograd.Function):
    """A custom op that maps rows one to one and saves nothing."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Square(torch.autograd.Function):
    """A custom op that saves its token-shaped input and maps rows one to one (as BLOOM's GELU)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class RunningSum(torch.autograd.Function):
    """Row-shaped, but its backward sums gradients along the positions."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


class ScaledByLength(torch.autograd.Function):
    """Row-shaped, but its backward divides by the sequence length it sees."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / x.shape[1]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / x.shape[1]


@pytest.mark.parametrize("custom", [Twice, Square])
def test_custom_function_mapping_rows_one_to_one_is_filtered_without_registration(custom):
    """trace_plan runs a Python custom Function's backward on cut rows and takes it where that gives
    the full backward's kept rows; its saved tensors are cut like an ATen op's."""
    model = TinyLM(custom=custom)
    plan = tiny_plan(model)
    ids = torch.randint(0, 64, (3, 29), generator=torch.Generator().manual_seed(4))
    keep = keep_mask(3, 29)
    got = {}
    for fn in (collider.filter_backward, collider.mask_backward):
        model.zero_grad()
        loss = tiny_loss(model, ids, keep)
        fn(loss, keep, plan, attention="kept_only")
        loss.backward()
        got[fn.__name__] = grads(model)
    assert max_rel_diff(got["filter_backward"], got["mask_backward"]) < 1e-5


@pytest.mark.parametrize("custom", [RunningSum, ScaledByLength])
def test_custom_function_not_mapping_rows_one_to_one_runs_whole(custom):
    """trace_plan sees that the Function's backward does not map rows one to one: it runs whole (its backward at
    full size, the dropped rows detached at its input), exact against an oracle written here: plain autograd with
    the dropped tokens' keys and values detached in the attention and the dropped rows at the Function's input
    (exact_query), and mask_backward (both semantics)."""
    model = TinyLM(custom=custom).double()
    plan = tiny_plan(model)
    for batch, ratio, seed in ((3, 0.5, 4), (2, 0.25, 5)):
        ids = torch.randint(0, 64, (batch, 29), generator=torch.Generator().manual_seed(seed))
        keep = keep_mask(batch, 29, ratio, seed)
        model.zero_grad()
        model.oracle_keep = keep
        tiny_loss(model, ids, keep).backward()
        model.oracle_keep = None
        oracle = grads(model)
        for attention in ("kept_only", "exact_query"):
            got = {}
            for fn in (collider.filter_backward, collider.mask_backward):
                model.zero_grad()
                loss = tiny_loss(model, ids, keep)
                stats = fn(loss, keep, plan, attention=attention)
                loss.backward()
                got[fn.__name__] = grads(model)
            assert stats.nodes_run_whole == 1, stats
            assert max_rel_diff(got["filter_backward"], got["mask_backward"]) < 1e-10
            if attention == "exact_query":
                assert max_rel_diff(got["filter_backward"], oracle) < 1e-10


def test_torch_compile_is_refused():
    model = tiny_model("llama", "eager", dtype=torch.float32)
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(collider.Error, match="torch.compile"):
        chf.trace_plan(compiled)
    # The core refuses the compiled graph too when the callable is written by hand.
    tiny = TinyLM()
    tiny_compiled = torch.compile(tiny, backend="aot_eager", dynamic=False)
    with pytest.raises(collider.Error) as e:
        collider.trace_plan(lambda b, t: tiny_loss(tiny_compiled, torch.randint(0, 64, (b, t)),
                                                   torch.ones(b, t, dtype=torch.bool)))
    assert "compile" in str(e.value).lower()


def test_use_cache_default_is_explained_or_works():
    """transformers' training forward with use_cache left at its default (True in the config)."""
    model = tiny_model("llama", "eager", use_cache=True)
    gen = torch.Generator().manual_seed(0)

    def loss_on_random_batch(batch, seq_len):
        ids = torch.randint(0, 128, (batch, seq_len), generator=gen)
        return model(input_ids=ids, labels=ids).loss  # use_cache not passed

    try:
        plan = collider.trace_plan(loss_on_random_batch)
    except collider.Error as e:
        assert "use_cache=False" in str(e), str(e)
        return
    ids = torch.randint(0, 128, (3, 37), generator=gen)
    keep = collider.select_tokens(torch.rand(3, 37, generator=gen), 0.5, valid=chf.keep_mask_from_labels(ids))
    for attention in ("kept_only", "exact_query"):
        model.zero_grad()
        loss = model(input_ids=ids, labels=chf.drop_labels(ids, keep)).loss
        try:
            collider.filter_backward(loss, keep, plan, attention=attention)
        except collider.Error as e:
            assert "use_cache=False" in str(e), str(e)
            return
        loss.backward()
        got = grads(model)
        model.zero_grad()
        with oracle_keep(model, keep, attention):
            model(input_ids=ids, labels=chf.drop_labels(ids, keep)).loss.backward()
        assert max_rel_diff(got, grads(model)) <= 1e-4


def test_hf_helpers_positions():
    ids = torch.arange(10).view(2, 5)
    keep = torch.tensor([[True, False, True, True, False], [False, True, True, False, False]])
    labels = chf.drop_labels(ids, keep)
    # position t predicts labels[t + 1]: dropping position t removes label t + 1
    assert labels.tolist() == [[0, 1, -100, 3, 4], [5, -100, 7, 8, -100]]
    assert chf.keep_mask_from_labels(labels).tolist() == [[True, False, True, True, False],
                                                          [False, True, True, False, False]]
    assert chf.shift_labels(ids)[:, -1].tolist() == [-100, -100]


def test_installed_package_imports_from_any_directory(tmp_path):
    """scripts/bootstrap.sh installs the package into the environment pytest runs in."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", "import collider, collider.hf; print(collider.__file__, "
                        "collider._C.TORCH_VERSION_BUILT)"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"`import collider` fails outside the checkout (run ./scripts/bootstrap.sh):\n{r.stderr}"
    path, built = r.stdout.split()
    assert "site-packages" in path and built == torch.__version__.split("+")[0]
