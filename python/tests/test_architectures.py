"""Architectures beyond the Llama-like grid, against their oracles, and the ones still refused.

- Gemma2ForCausalLM (eager; transformers has no SDPA path for it): attention logit soft-capping,
  cap * tanh(s / cap) between the two matmuls, and final-logit soft-capping; both semantics,
  equal and ragged (batch_topk) kept counts.
- FalconForCausalLM with multi-query attention (one key/value head for four query heads), eager
  and SDPA; exact_query against an oracle that detaches the dropped tokens' key and value rows
  where Falcon splits its fused QKV (oracle.falcon_oracle_keep: Falcon's attention does not
  dispatch through transformers' AttentionInterface, so the shared oracle cannot stand in).
- BloomForCausalLM: ALiBi biases added by baddbmm (the Q K^T of its attention cores), and its GELU
  a Python custom autograd Function that saves its token-shaped input, which trace_plan runs on
  cut rows to see that it maps rows one to one; both semantics, against an oracle that replaces
  BLOOM's attention forward with the same math and the oracle's detaches
  (oracle.bloom_oracle_keep); and under activation checkpointing, where the GELU's saved input
  exists only behind checkpointing's hooks (3 fresh models). (Mixtures of experts: test_moe.py.)
Tiny random models, float64, B = 3, T = 37, filter ratios 0.25 and 0.5, both loss forms; max
relative difference <= 1e-4 (Gemma2's norms run in float32).
  pytest python/tests/test_architectures.py
"""
import pytest

import collider.hf as chf

from oracle import bloom_oracle_keep, falcon_oracle_keep, grads, max_rel_diff, tiny_model
from test_hf_gradients import (LOSS_FORMS, TOL, batch_and_mask, collider_grads, model_for, oracle_grads, plain_grads,
                               plan_for, ragged_batch, step_loss)


@pytest.mark.parametrize("form", LOSS_FORMS)
def test_gemma2_soft_capping_matches_oracle(form):
    model = model_for("gemma2", "eager")
    plan = plan_for("gemma2", "eager", form)
    worst, apart = {}, {}
    for attention in ("kept_only", "exact_query"):
        for ratio in (0.25, 0.5):
            ids, keep = batch_and_mask(3, ratio, seed=300 + int(ratio * 100))
            got, _, stats = collider_grads(model, plan, form, ids, keep, attention)
            assert stats.tensors_gathered > 0
            ref, _ = oracle_grads(model, form, ids, keep, attention)
            worst[(attention, ratio)] = max_rel_diff(got, ref)
            apart[(attention, ratio)] = max_rel_diff(plain_grads(model, form, ids, keep)[0], ref)
        # Ragged rows (RHO-1's batch_topk): the soft-capped cores stay on the padded path.
        ids, keep = ragged_batch(seed=3)
        got, _, _ = collider_grads(model, plan, form, ids, keep, attention)
        worst[(attention, "batch_topk")] = max_rel_diff(got, oracle_grads(model, form, ids, keep, attention)[0])
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"gemma2/{form}: max relative gradient difference above {TOL}: {bad}"
    # The oracle soft-caps as the model does, and a plain backward is far from it.
    assert min(apart.values()) > 1e-2, apart


def test_gemma2_graph_has_the_soft_cap_in_its_attention_cores():
    model = model_for("gemma2", "eager")
    ids, keep = batch_and_mask(3, 0.5, seed=7)
    loss = step_loss(model, "per_token", ids, keep)
    seen, stack, types = set(), [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        types.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    assert "TanhBackward0" in types


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_falcon_multi_query_exact_query_matches_oracle(attn, form):
    model = model_for("falcon", attn)
    assert model.config.multi_query and model.transformer.h[0].self_attention.num_kv_heads == 1
    plan = plan_for("falcon", attn, form)
    worst, apart = {}, {}
    for ratio in (0.25, 0.5):
        ids, keep = batch_and_mask(3, ratio, seed=500 + int(ratio * 100))
        got, _, _ = collider_grads(model, plan, form, ids, keep, "exact_query")
        model.zero_grad(set_to_none=True)
        with falcon_oracle_keep(model, keep):
            step_loss(model, form, ids, keep).backward()
        ref = grads(model)
        worst[ratio] = max_rel_diff(got, ref)
        apart[ratio] = max_rel_diff(plain_grads(model, form, ids, keep)[0], ref)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"falcon/{attn}/{form}: max relative gradient difference above {TOL}: {bad}"
    assert min(apart.values()) > 1e-2, apart


@pytest.mark.parametrize("form", LOSS_FORMS)
def test_bloom_alibi_and_custom_gelu_match_oracle(form):
    model = model_for("bloom", "eager")
    plan = plan_for("bloom", "eager", form)
    assert "exact_query available" in plan.summary(), plan.summary()  # the ALiBi cores recognised
    worst, apart = {}, {}
    for attention in ("kept_only", "exact_query"):
        for ratio in (0.25, 0.5):
            ids, keep = batch_and_mask(3, ratio, seed=900 + int(ratio * 100))
            got, _, stats = collider_grads(model, plan, form, ids, keep, attention)
            assert stats.tensors_gathered > 0
            model.zero_grad(set_to_none=True)
            with bloom_oracle_keep(model, keep, attention):
                step_loss(model, form, ids, keep).backward()
            ref = grads(model)
            worst[(attention, ratio)] = max_rel_diff(got, ref)
            apart[(attention, ratio)] = max_rel_diff(plain_grads(model, form, ids, keep)[0], ref)
        # Ragged rows (batch_topk): the ALiBi cores stay on the padded path.
        ids, keep = ragged_batch(seed=5)
        got, _, _ = collider_grads(model, plan, form, ids, keep, attention)
        model.zero_grad(set_to_none=True)
        with bloom_oracle_keep(model, keep, attention):
            step_loss(model, form, ids, keep).backward()
        worst[(attention, "batch_topk")] = max_rel_diff(got, grads(model))
    print(f"bloom/{form}: {worst}")
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"bloom/{form}: max relative gradient difference above {TOL}: {bad}"
    assert min(apart.values()) > 1e-2, apart


def test_bloom_under_activation_checkpointing_matches_oracle():
    """The row check reads the GELU's saved input as the trace did (behind checkpointing's hooks it
    can be unpacked only once); the training step cuts it when the backward recomputes it."""
    worst = {}
    for seed in range(3):
        model = tiny_model("bloom", "eager", seed=seed)
        model.gradient_checkpointing_enable()
        plan = chf.trace_plan(model, loss="per_token")
        for attention in ("kept_only", "exact_query"):
            ids, keep = batch_and_mask(3, 0.4, seed=40 + seed)
            got, _, _ = collider_grads(model, plan, "per_token", ids, keep, attention)
            model.gradient_checkpointing_disable()
            model.zero_grad(set_to_none=True)
            with bloom_oracle_keep(model, keep, attention):
                step_loss(model, "per_token", ids, keep).backward()
            model.gradient_checkpointing_enable()
            worst[(seed, attention)] = max_rel_diff(got, grads(model))
    assert all(v <= TOL for v in worst.values()), worst
