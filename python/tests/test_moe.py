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
the kept tokens (collider.hf.training_loss(router_aux=True)) against the same oracle. What is
refused, briefly and with the graph untouched: grouped experts, GPT-OSS's attention sinks. A batch
in which an expert receives no token (its route absent from the graph) is filtered exactly, and so
are the routes behind checkpointing, offloading and save_on_cpu.
  pytest python/tests/test_moe.py
"""
import contextlib

import pytest
import torch

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, moe_inputs_detached, oracle_keep, tiny_model
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


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_matches_oracle(family, attn, form):
    model = model_for(family, attn)
    plan = plan_for(family, attn, form)
    worst, apart = {}, {}
    for attention in ("kept_only", "exact_query"):
        points = [(ratio, *batch_and_mask(3, ratio, seed=700 + int(ratio * 100))) for ratio in (0.25, 0.5)]
        points.append(("batch_topk", *ragged_batch(seed=11)))
        for name, ids, keep in points:
            got, ref, stats = collider_and_oracle(model, plan, lambda: step_loss(model, form, ids, keep), keep,
                                                  attention)
            assert stats.tensors_gathered > 0
            worst[(attention, name)] = max_rel_diff(got, ref)
            apart[(attention, name)] = max_rel_diff(plain_grads(model, form, ids, keep)[0], ref)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{family}/{attn}/{form}: max relative gradient difference above {TOL}: {bad}"
    assert min(apart.values()) > 1e-2, apart


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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_over_kept_tokens_matches_oracle(family):
    model = model_for(family, "eager")
    plan = chf.trace_plan(model, loss="per_token", router_aux=True)
    worst = {}
    for attention in ("kept_only", "exact_query"):
        ids, keep = batch_and_mask(3, 0.5, seed=31)

        def loss_fn():
            return chf.training_loss(model, ids, ids, keep, loss="per_token", router_aux=True)

        got, ref, _ = collider_and_oracle(model, plan, loss_fn, keep, attention)
        worst[attention] = max_rel_diff(got, ref)
        # The aux loss reaches the routers: their gradients differ from the loss without it.
        without, _, _ = collider_and_oracle(model, plan_for(family, "eager", "per_token"),
                                            lambda: step_loss(model, "per_token", ids, keep), keep, attention)
        routers = [k for k in ref if k.endswith("gate.weight") and "shared" not in k]
        assert routers and max(float((ref[k] - without[k]).abs().max()) for k in routers) > 1e-6
    assert all(v <= TOL for v in worst.values()), worst


def test_router_aux_loss_refuses_a_dense_model():
    with pytest.raises(collider.Error, match="not a transformers mixture-of-experts model"):
        chf.router_aux_loss(tiny_model("llama", "eager"), (torch.zeros(3, 4),), torch.ones(1, 3, dtype=torch.bool))


def _refused_on_trace(model, needle):
    with pytest.raises(collider.Error) as refused:
        chf.trace_plan(model, loss="per_token")
    msg = str(refused.value)
    assert needle in msg and len(msg) <= 300 and "register_passthrough_node" not in msg, msg
    ids, keep = batch_and_mask(3, 0.5, seed=9)
    model.zero_grad(set_to_none=True)
    step_loss(model, "per_token", ids, keep).backward()  # a plain backward still works
    assert grads(model)


def test_grouped_experts_are_refused_with_the_eager_advice():
    _refused_on_trace(tiny_model("mixtral", "eager", dtype=torch.float32, experts_implementation="grouped_mm"),
                      'experts_implementation="eager"')


def test_gpt_oss_attention_sinks_are_refused_briefly():
    from transformers import AutoModelForCausalLM, GptOssConfig
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=128, use_cache=False, attn_implementation="eager",
                       experts_implementation="eager")
    _refused_on_trace(AutoModelForCausalLM.from_config(cfg).double().train(), "SliceBackward0")


def _scatters(loss) -> int:
    """The number of routes (IndexAddBackward0 nodes, one per expert that received a token) in the graph."""
    seen, stack, n = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        n += type(node).__name__ == "IndexAddBackward0"
        stack.extend(next_node for next_node, _ in node.next_functions)
    return n


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
