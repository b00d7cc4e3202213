"""Mixtures of experts: Collider's gradients on transformers' MoE models against the oracle.

Families (tiny random configs, 4 experts, top-2, experts_implementation="eager", float64):
Mixtral; Qwen2-MoE (a shared expert with its sigmoid gate beside the routed ones); Qwen3-MoE (q/k
norms, renormalised top-k weights); OLMoE; DeepSeek-V3 (multi-head latent attention, whose keys
are assembled in place, key_states[..., :n].copy_(k_nope); a shared expert; top-k within the
top groups of experts). attn_implementation eager and sdpa; both semantics;
both loss forms (the per-token loss and transformers' labels loss); B = 3, T = 37, filter ratios
0.25 and 0.5, and ragged kept counts (batch_topk). The oracle: attention as everywhere
(oracle.oracle_keep), and each MoE block's input rows of dropped tokens detached
(oracle.moe_inputs_detached: torch.where(keep, x, x.detach())), so the experts and the router
give dropped tokens nothing. Max relative difference <= 1e-4 (transformers' eager softmax runs in
float32); a plain backward of the same loss is far from the oracle. The load-balancing loss over
the kept tokens (collider.hf.training_loss(router_aux=True)) against the same oracle. Grouped
experts (experts_implementation="grouped_mm", transformers' default: the token-expert pairs sorted
by expert, torch._grouped_mm over them) in float32, which grouped_mm needs on the CPU, against the
same oracle, bound 1e-3, with their GEMMs cut to the kept pairs. What is refused, briefly and with
the graph untouched: grouped experts with one expert per token, attention sinks written other than
as GPT-OSS writes them. GPT-OSS (attention sinks, eager attention only) with both experts
implementations, and attention sinks written by hand. A batch
in which an expert receives no token (its route absent from the graph) is filtered exactly, and so
are the routes behind checkpointing, offloading and save_on_cpu, grouped or not.
  pytest python/tests/test_moe.py
"""
import contextlib
import functools

import pytest
import torch

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, moe_inputs_detached, oracle_keep, tiny_config, tiny_model
from test_hf_gradients import (LOSS_FORMS, T, TOL, batch_and_mask, model_for, plain_grads, plan_for, ragged_batch,
                               step_loss)

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def collider_and_oracle(model, plan, loss_fn, keep, attention):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    stats = collider.filter_backward(loss, keep, plan, attention=attention)
    loss.backward()
    got = grads(model)
    model.zero_grad(set_to_none=True)
    with oracle_keep(model, keep, attention), moe_inputs_detached(model, keep):
        loss_fn().backward()
    return got, grads(model), stats


def assert_matches_oracle(model, plan, form, tol, label, seed=700):
    """Collider's gradients against the oracle in both semantics at filter ratios 0.25 and 0.5 (B = 3)
    and on ragged rows: within tol, and a plain backward far from the oracle."""
    worst, apart = {}, {}
    for attention in ("kept_only", "exact_query"):
        points = [(ratio, *batch_and_mask(3, ratio, seed=seed + int(ratio * 100))) for ratio in (0.25, 0.5)]
        points.append(("batch_topk", *ragged_batch(seed=11)))
        for name, ids, keep in points:
            got, ref, stats = collider_and_oracle(model, plan, lambda: step_loss(model, form, ids, keep), keep,
                                                  attention)
            assert stats.tensors_gathered > 0
            worst[(attention, name)] = max_rel_diff(got, ref)
            apart[(attention, name)] = max_rel_diff(plain_grads(model, form, ids, keep)[0], ref)
    bad = {k: v for k, v in worst.items() if not v <= tol}
    assert not bad, f"{label}/{form}: max relative gradient difference above {tol}: {bad}"
    assert min(apart.values()) > 1e-2, apart


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_matches_oracle(family, attn, form):
    assert_matches_oracle(model_for(family, attn), plan_for(family, attn, form), form, TOL, f"{family}/{attn}")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_plan_has_one_route_per_expert_and_layer(family):
    """Every expert of every layer is a route (its rows cut to the kept tokens it received)."""
    text = plan_for(family, "eager", "per_token").to_string().split("collider-plan")[1]  # the B > 1 variant
    model = model_for(family, "eager")
    routes = {int(dim.split(":")[4]) for line in text.splitlines() if line.startswith("field ")
              for dim in line.split()[-1].split(",") if dim.count(":") == 4}
    assert len(routes) == model.config.num_hidden_layers * 4, routes


def test_one_row_batches_use_the_one_row_plan():
    model = model_for("mixtral", "eager")
    plan = plan_for("mixtral", "eager", "per_token")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (1, 97), generator=gen)
    keep = collider.select_tokens(torch.rand(1, 97, generator=gen), 0.4, valid=chf.keep_mask_from_labels(ids))
    for attention in ("kept_only", "exact_query"):
        got, ref, _ = collider_and_oracle(model, plan, lambda: step_loss(model, "per_token", ids, keep), keep,
                                          attention)
        assert max_rel_diff(got, ref) <= TOL


AUX_MODELS = {  # the model and its bound
    "mixtral": lambda: (model_for("mixtral", "eager"), TOL),
    "qwen3_moe": lambda: (model_for("qwen3_moe", "eager"), TOL),
    "mixtral_grouped": lambda: (grouped_model("mixtral", "eager"), GROUPED_TOL),
    "gpt_oss": lambda: (gpt_oss("eager"), TOL),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("which", AUX_MODELS)
def test_router_aux_loss_over_kept_tokens_matches_oracle(which):
    model, tol = AUX_MODELS[which]()
    plan = chf.trace_plan(model, loss="per_token", router_aux=True)
    plain_plan = chf.trace_plan(model, loss="per_token")
    worst = {}
    for attention in ("kept_only", "exact_query"):
        ids, keep = batch_and_mask(3, 0.5, seed=31)

        def loss_fn():
            return chf.training_loss(model, ids, ids, keep, loss="per_token", router_aux=True)

        got, ref, _ = collider_and_oracle(model, plan, loss_fn, keep, attention)
        worst[attention] = max_rel_diff(got, ref)
        # The aux loss reaches the routers: their gradients differ from the loss without it.
        without, _, _ = collider_and_oracle(model, plain_plan, lambda: step_loss(model, "per_token", ids, keep), keep,
                                            attention)
        routers = [k for k in ref if k.endswith(("gate.weight", "router.weight")) and "shared" not in k]
        assert routers and max(float((ref[k] - without[k]).abs().max()) for k in routers) > 1e-6
    assert all(v <= tol for v in worst.values()), worst


def test_router_aux_loss_refuses_a_dense_model():
    with pytest.raises(collider.Error, match="not a transformers mixture-of-experts model"):
        chf.router_aux_loss(tiny_model("llama", "eager"), (torch.zeros(3, 4),), torch.ones(1, 3, dtype=torch.bool))


def _refused_on_trace(model, needle, error=collider.Error):
    with pytest.raises(error) as refused:
        chf.trace_plan(model, loss="per_token")
    msg = str(refused.value)
    assert needle in msg and len(msg) <= 300 and "register_passthrough_node" not in msg, msg
    ids, keep = batch_and_mask(3, 0.5, seed=9)
    model.zero_grad(set_to_none=True)
    step_loss(model, "per_token", ids, keep).backward()  # a plain backward still works
    assert grads(model)


def _collapsed_router(model):
    """Every token to the same experts (all router logits zero: top-k picks the first k), as a new
    model's router often nearly does."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.zero_()
    return model


def test_a_collapsed_router_is_refused_with_the_grouped_advice_and_grouped_experts_are_exact():
    """With eager experts, the two experts that get every token have B*T rows in every trace (and
    the others none), which no retry on other random tokens changes: refused, the advice naming
    grouped experts, whose graph does not depend on the routing; they filter it exactly."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    eager = _collapsed_router(AutoModelForCausalLM.from_config(tiny_config("mixtral", "eager")).double().train())
    assert issubclass(collider.UntraceableRoutes, collider.Error)
    _refused_on_trace(eager, 'experts_implementation="grouped_mm"', collider.UntraceableRoutes)
    grouped = _collapsed_router(tiny_model("mixtral", "eager", dtype=torch.float32,
                                           experts_implementation="grouped_mm"))
    assert_matches_oracle(grouped, chf.trace_plan(grouped, loss="per_token"), "per_token", GROUPED_TOL,
                          "mixtral/eager/grouped, collapsed router")


# Grouped experts: torch._grouped_mm takes float32, bfloat16 or float16 on the CPU, so these run in
# float32 against the bound the float32 models get (1e-3; measured ~2e-6).
GROUPED_TOL = 1e-3


@functools.lru_cache(maxsize=None)
def grouped_model(family: str, attn: str):
    return tiny_model(family, attn, dtype=torch.float32, experts_implementation="grouped_mm")


@functools.lru_cache(maxsize=None)
def grouped_plan(family: str, attn: str, form: str):
    return chf.trace_plan(grouped_model(family, attn), loss="per_token" if form == "per_token" else "labels")


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_experts_match_oracle(family, attn, form):
    assert_matches_oracle(grouped_model(family, attn), grouped_plan(family, attn, form), form, GROUPED_TOL,
                          f"{family}/{attn}/grouped")


def _nodes(loss, name: str) -> list:
    seen, stack, out = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            out.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return out


@pytest.mark.parametrize("ragged", [False, True])
def test_grouped_experts_gemms_run_on_the_kept_pairs(ragged):
    """Every grouped GEMM's backward runs on the kept tokens' k pairs alone, its offsets counting the
    kept pairs of each expert."""
    model, plan = grouped_model("mixtral", "eager"), grouped_plan("mixtral", "eager", "per_token")
    k = model.config.num_experts_per_tok
    ids, keep = ragged_batch(seed=11) if ragged else batch_and_mask(3, 0.5, seed=3)
    loss = step_loss(model, "per_token", ids, keep)
    before = [(n._saved_self.shape[0], n._saved_offs.clone()) for n in _nodes(loss, "GroupedMmBackward0")]
    collider.filter_backward(loss, keep, plan, attention="kept_only")
    after = [(n._saved_self.shape[0], n._saved_offs.clone()) for n in _nodes(loss, "GroupedMmBackward0")]
    assert len(after) == 2 * model.config.num_hidden_layers
    for (rows, offs), (cut_rows, cut_offs) in zip(before, after):
        assert rows == keep.numel() * k and cut_rows == int(keep.sum()) * k
        assert int(cut_offs[-1]) == cut_rows and bool((cut_offs <= offs).all())
        assert bool((cut_offs[1:] >= cut_offs[:-1]).all())
    loss.backward()


GROUPED_HOOKS = {
    "checkpointing": (lambda m: m.gradient_checkpointing_enable(), contextlib.nullcontext),
    "save_on_cpu": (lambda m: None, torch.autograd.graph.save_on_cpu),
}


@pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")
@pytest.mark.parametrize("setup", GROUPED_HOOKS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_experts_behind_saved_tensor_hooks_match_oracle(family, attn, setup):
    """Behind checkpointing or save_on_cpu a grouped route is not cut (its order exists only when the
    backward unpacks it): its pairs run whole, a dropped token's with a zero gradient."""
    model = tiny_model(family, attn, dtype=torch.float32, experts_implementation="grouped_mm")
    GROUPED_HOOKS[setup][0](model)
    model.train()
    plan = chf.trace_plan(model, loss="per_token")
    reference = grouped_model(family, attn)  # the same weights, no hooks
    worst = {}
    for name, (ids, keep) in (("0.5", batch_and_mask(3, 0.5, seed=53)), ("batch_topk", ragged_batch(seed=11))):
        for attention in ("kept_only", "exact_query"):
            model.zero_grad(set_to_none=True)
            with GROUPED_HOOKS[setup][1]():
                loss = step_loss(model, "per_token", ids, keep)
            stats = collider.filter_backward(loss, keep, plan, attention=attention)
            loss.backward()
            assert stats.tensors_hooked > 0
            reference.zero_grad(set_to_none=True)
            with oracle_keep(reference, keep, attention), moe_inputs_detached(reference, keep):
                step_loss(reference, "per_token", ids, keep).backward()
            worst[(name, attention)] = max_rel_diff(grads(model), grads(reference))
    bad = {k: v for k, v in worst.items() if not v <= GROUPED_TOL}
    assert not bad, f"{family}/{attn}/{setup}: max relative gradient difference above {GROUPED_TOL}: {bad}"


def test_grouped_experts_with_one_expert_per_token_are_refused_with_the_eager_advice():
    """Top-1 grouped experts: the sorted pairs are as many as the token rows, which the plan cannot
    tell apart from them."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config("mixtral", "eager", experts_implementation="grouped_mm")
    cfg.num_experts_per_tok = 1
    torch.manual_seed(0)
    _refused_on_trace(AutoModelForCausalLM.from_config(cfg).float().train(), 'experts_implementation="eager"')


# GPT-OSS: attention sinks (one more softmax logit per head: cat(scores, sinks), minus the row
# maximum, softmax, [..., :-1]), alternating sliding windows, biased experts with a clamped gate.
# transformers runs it with eager attention only. Its experts both ways: eager in float64, grouped in
# float32 (GROUPED_TOL).
GPT_OSS_EXPERTS = {"eager": (torch.float64, TOL), "grouped_mm": (torch.float32, GROUPED_TOL)}


@functools.lru_cache(maxsize=None)
def gpt_oss(experts: str):
    return tiny_model("gpt_oss", "eager", dtype=GPT_OSS_EXPERTS[experts][0], experts_implementation=experts)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("experts", GPT_OSS_EXPERTS)
def test_gpt_oss_attention_sinks_match_oracle(experts, form):
    model, tol = gpt_oss(experts), GPT_OSS_EXPERTS[experts][1]
    plan = chf.trace_plan(model, loss="per_token" if form == "per_token" else "labels")
    assert "exact_query available" in repr(plan) and "detach " in plan.to_string()
    assert_matches_oracle(model, plan, form, tol, f"gpt_oss/{experts}", seed=900)
    assert model.model.layers[0].self_attn.sinks.grad is not None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gpt_oss_keys_are_cut_with_their_sinks_kept():
    """kept_only: the probabilities the softmax saved keep the kept key columns and the sink column
    ([.., N, N + 1]); exact_query keeps every key column and the sink ([.., N, T + 1])."""
    model = gpt_oss("eager")
    plan = chf.trace_plan(model, loss="per_token")
    ids, keep = batch_and_mask(3, 0.5, seed=4)
    n, t = int(keep.sum(1)[0]), ids.shape[1]
    for attention, keys in (("kept_only", n + 1), ("exact_query", t + 1)):
        loss = step_loss(model, "per_token", ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        softmax = _nodes(loss, "SoftmaxBackward0")
        probabilities = [tuple(s._saved_result.shape) for s in softmax if s._saved_result.dim() == 4]
        assert probabilities and all(p[-2:] == (n, keys) for p in probabilities), probabilities
        loss.backward()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("which", ["mixtral_grouped", "gpt_oss_grouped"])
def test_grouped_and_sink_plans_survive_their_text_form(which):
    """A plan's text form keeps grouped routes (their offsets, token slots and weights' slots) and
    the detached row maximum: the plan read back filters to the same gradients."""
    model = grouped_model("mixtral", "eager") if which == "mixtral_grouped" else gpt_oss("grouped_mm")
    plan = chf.trace_plan(model, loss="per_token")
    again = collider.Plan.from_string(plan.to_string())
    assert again.to_string() == plan.to_string()
    ids, keep = ragged_batch(seed=11)
    for attention in ("kept_only", "exact_query"):
        got = [collider_and_oracle(model, p, lambda: step_loss(model, "per_token", ids, keep), keep, attention)[0]
               for p in (plan, again)]
        assert max_rel_diff(got[1], got[0]) == 0.0


class _SinkAttention(torch.nn.Module):
    """One attention layer with a sink logit per head, written three ways: sinks appended and sliced
    off with [..., :-1] or [..., :T] (followed), or prepended (refused)."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(3)
        self.how, self.emb = how, torch.nn.Embedding(64, 16)
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 64)
        self.sinks = torch.nn.Parameter(torch.randn(2))

    def forward(self, ids, keep=None, attention=None):
        B, T = ids.shape
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.qkv(self.emb(ids)).chunk(3, dim=-1))
        if keep is not None:  # the oracle (DESIGN.md section 3): dropped keys and values detached ...
            kv = keep[:, None, :, None]
            k, v = torch.where(kv, k, k.detach()), torch.where(kv, v, v.detach())
        s = (q @ k.transpose(2, 3)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        sink = self.sinks.view(1, 2, 1, 1).expand(B, 2, T, 1)
        s = torch.cat([sink, s] if self.how == "prepended" else [s, sink], dim=-1)
        col = torch.cat([keep[:, None, None, :], torch.ones(B, 1, 1, 1, dtype=torch.bool)], -1) if keep is not None else None
        if keep is not None and attention == "kept_only":  # ... and their score columns too
            s = torch.where(col, s, s.detach())
        if keep is None:
            s = s - s.max(dim=-1, keepdim=True).values
        p = torch.softmax(s, dim=-1)
        if keep is not None and attention == "kept_only":
            p = torch.where(col, p, p.detach())
        p = p[..., 1:] if self.how == "prepended" else p[..., :-1] if self.how == "appended" else p[..., :T]
        return self.out((p @ v).transpose(1, 2).reshape(B, T, 16))


def _sink_loss(model, ids, keep, oracle=None):
    logits = model(ids, keep if oracle else None, oracle)
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape)
    return (losses * keep).sum() / keep.sum()


@pytest.mark.parametrize("how", ["appended", "sliced_to_T"])
def test_attention_sinks_written_by_hand_match_oracle(how):
    model = _SinkAttention(how).double()

    def loss_on_random_batch(batch, seq_len):
        ids = torch.randint(0, 64, (batch, seq_len))
        return _sink_loss(model, ids, torch.rand(batch, seq_len) > 0.5)

    plan = collider.trace_plan(loss_on_random_batch)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (3, 23), generator=gen)
    keep = collider.select_tokens(torch.rand(3, 23, generator=gen), 0.4)
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = _sink_loss(model, ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        got = grads(model)
        model.zero_grad(set_to_none=True)
        _sink_loss(model, ids, keep, oracle=attention).backward()
        assert max_rel_diff(got, grads(model)) <= 1e-10, (how, attention)


def test_attention_sinks_prepended_are_refused():
    model = _SinkAttention("prepended").double()
    with pytest.raises(collider.Error, match="sinks") as refused:
        collider.trace_plan(lambda b, t: _sink_loss(model, torch.randint(0, 64, (b, t)), torch.rand(b, t) > 0.5))
    assert len(str(refused.value)) <= 300, str(refused.value)


def _scatters(loss) -> int:
    """The number of routes (IndexAddBackward0 nodes, one per expert that received a token) in the graph."""
    return len(_nodes(loss, "IndexAddBackward0"))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_expert_without_tokens_is_filtered_exactly(family):
    """transformers' eager experts skip an expert that receives no token of the step, so the graph
    lacks its route: filter_backward matches the rest of the graph to the plan and equals the
    oracle, on short batches of one row and of three (both plan variants), in both semantics."""
    model = model_for(family, "eager")
    plan = plan_for(family, "eager", "per_token")
    routes = model.config.num_hidden_layers * 4
    for batch, seq_len in ((1, 3), (3, 5)):
        for seed in range(400):  # a batch in which some expert of some layer receives no token
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, 128, (batch, seq_len), generator=gen)
            keep = chf.keep_mask_from_labels(ids) & (torch.rand(batch, seq_len, generator=gen) > 0.4)
            keep[:, 0], keep[:, 1] = False, True  # a kept token after a dropped one in every row
            if _scatters(step_loss(model, "per_token", ids, keep)) < routes:
                break
        else:
            pytest.fail(f"no [{batch}, {seq_len}] batch left an expert unused")
        for attention in ("kept_only", "exact_query"):
            got, ref, stats = collider_and_oracle(model, plan, lambda: step_loss(model, "per_token", ids, keep),
                                                  keep, attention)
            assert max_rel_diff(got, ref) <= TOL, (batch, seed, attention, max_rel_diff(got, ref))
        assert max_rel_diff(plain_grads(model, "per_token", ids, keep)[0], ref) > 1e-2


def test_a_graph_that_differs_otherwise_is_still_refused():
    """A plan of another mixture-of-experts model is refused with the usual advice, graph untouched."""
    model = model_for("mixtral", "eager")
    ids, keep = batch_and_mask(3, 0.5, seed=9)
    loss = step_loss(model, "per_token", ids, keep)
    with pytest.raises(collider.Error, match="the plan expects") as refused:
        collider.filter_backward(loss, keep, plan_for("olmoe", "eager", "per_token"), attention="kept_only")
    assert len(str(refused.value)) <= 300, str(refused.value)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert max_rel_diff(grads(model), plain_grads(model, "per_token", ids, keep)[0]) == 0.0


# Saved-tensor hooks around the mixture-of-experts layers: transformers' checkpointing (non-reentrant,
# what gradient_checkpointing_enable() gives), checkpointing with offload to the CPU, and save_on_cpu
# around the forward. Each route's index then exists only when the backward unpacks it: the route
# runs on all its rows, a dropped token's with a zero gradient (routes.h). Every family, eager and
# SDPA, both loss forms, both semantics, ratios 0.25 and 0.5 and ragged rows, against the oracle on
# a model with the same weights and no hooks.
HOOK_SETUPS = {
    "checkpointing": (lambda m: m.gradient_checkpointing_enable(), contextlib.nullcontext),
    "offload": (lambda m: m.activation_checkpointing_enable(offload=True), contextlib.nullcontext),
    "save_on_cpu": (lambda m: None, torch.autograd.graph.save_on_cpu),
}


def hooked_model(family, attn, setup):
    model = tiny_model(family, attn)
    HOOK_SETUPS[setup][0](model)
    return model.train()


@pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")
@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("setup", HOOK_SETUPS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_behind_saved_tensor_hooks_matches_oracle(family, attn, setup, form):
    model, context = hooked_model(family, attn, setup), HOOK_SETUPS[setup][1]
    plan = chf.trace_plan(model, loss="per_token" if form == "per_token" else "labels")
    reference = tiny_model(family, attn)  # the same weights, no hooks
    worst = {}
    points = [(str(ratio), batch_and_mask(3, ratio, seed=3 + int(ratio * 100))) for ratio in (0.25, 0.5)]
    for name, (ids, keep) in points + [("batch_topk", ragged_batch(seed=11))]:
        for attention in ("kept_only", "exact_query"):
            model.zero_grad(set_to_none=True)
            with context():
                loss = step_loss(model, form, ids, keep)
            stats = collider.filter_backward(loss, keep, plan, attention=attention)
            loss.backward()
            assert stats.tensors_hooked > 0
            reference.zero_grad(set_to_none=True)
            with oracle_keep(reference, keep, attention), moe_inputs_detached(reference, keep):
                step_loss(reference, form, ids, keep).backward()
            want = grads(reference)
            worst[(name, attention)] = max_rel_diff(grads(model), want)
    assert max_rel_diff(plain_grads(reference, form, ids, keep)[0], want) > 1e-2
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{family}/{attn}/{setup}/{form}: max relative gradient difference above {TOL}: {bad}"


@pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")
def test_moe_behind_checkpointing_validates_and_masks_alike():
    """validate=True (the filtered gradient checked against mask_backward's in the same step) passes,
    and mask_backward gives the oracle's gradient, with the routes behind checkpointing."""
    model = hooked_model("qwen3_moe", "eager", "checkpointing")
    plan = chf.trace_plan(model, loss="per_token")
    ids, keep = batch_and_mask(3, 0.25, seed=8)
    got = {}
    for how in ("validate", "mask"):
        model.zero_grad(set_to_none=True)
        loss = step_loss(model, "per_token", ids, keep)
        if how == "validate":
            collider.filter_backward(loss, keep, plan, attention="kept_only", validate=True)
        else:
            collider.mask_backward(loss, keep, plan, attention="kept_only")
        loss.backward()
        got[how] = grads(model)
    reference = tiny_model("qwen3_moe", "eager")
    with oracle_keep(reference, keep, "kept_only"), moe_inputs_detached(reference, keep):
        step_loss(reference, "per_token", ids, keep).backward()
    assert max_rel_diff(got["validate"], grads(reference)) <= TOL
    assert max_rel_diff(got["mask"], grads(reference)) <= TOL


@pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")
def test_an_expert_without_tokens_behind_checkpointing_is_filtered_exactly():
    model = hooked_model("mixtral", "eager", "checkpointing")
    plan = chf.trace_plan(model, loss="per_token")
    reference = tiny_model("mixtral", "eager")
    for seed in range(400):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 128, (3, 5), generator=gen)
        keep = chf.keep_mask_from_labels(ids) & (torch.rand(3, 5, generator=gen) > 0.4)
        keep[:, 0], keep[:, 1] = False, True
        if _scatters(step_loss(reference, "per_token", ids, keep)) < reference.config.num_hidden_layers * 4:
            break
    else:
        pytest.fail("no [3, 5] batch left an expert unused")
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = step_loss(model, "per_token", ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        reference.zero_grad(set_to_none=True)
        with oracle_keep(reference, keep, attention), moe_inputs_detached(reference, keep):
            step_loss(reference, "per_token", ids, keep).backward()
        assert max_rel_diff(grads(model), grads(reference)) <= TOL, (seed, attention)
