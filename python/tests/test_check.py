"""filter_backward's check against mask_backward, on first use by default (FilterOptions::check_every,
DESIGN.md section 4): the first step of each kind a plan serves (traced variant, semantics, equal or
ragged kept counts) runs its backward through the rewrite and through mask_backward inside the call
and refuses a difference with collider.GradientMismatch, which names the node whose gradient first
differs and leaves the graph as it was; then every check_every-th step is checked again. A checked
step's gradient is the unchecked step's. A wrong plan (its text altered to cut rows in the wrong
order) is caught on its first step.
  pytest python/tests/test_check.py
"""
import re

import pytest
import torch

import collider
from test_unseen_ops import PatternLM, batch, grads_of, masked_loss, max_rel, plan_for


def step(model, plan, ids, keep, **kw):
    model.zero_grad(set_to_none=True)
    loss = masked_loss(model, ids, keep)
    stats = collider.filter_backward(loss, keep, plan, **kw)
    loss.backward()
    return stats


def ragged(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (3, 37), generator=g)
    return ids, collider.select_tokens(torch.rand(3, 37, generator=g), 0.5, policy="batch_topk")


def test_the_first_step_of_each_kind_is_checked_then_every_nth():
    model = PatternLM("none")
    plan = plan_for(model)
    ids, keep = batch(3, 0.5, seed=1)
    assert collider.DEFAULT_CHECK_EVERY == 1000
    seen = [step(model, plan, ids, keep).checked for _ in range(3)]
    seen += [step(model, plan, ids, keep, attention="exact_query").checked for _ in range(2)]
    seen += [step(model, plan, *ragged(2)).checked for _ in range(2)]
    ids1, keep1 = batch(1, 0.5, seed=3)  # the plan's B = 1 variant
    seen += [step(model, plan, ids1, keep1).checked for _ in range(2)]
    assert seen == [1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert step(model, plan, ids, keep, validate=True).checked == 1  # validate checks every step it is given

    every = plan_for(model)
    assert [step(model, every, ids, keep, check_every=3).checked for _ in range(7)] == [1, 0, 1, 0, 0, 1, 0]
    off = plan_for(model)
    assert [step(model, off, ids, keep, check_every=0).checked for _ in range(3)] == [0, 0, 0]
    # A plan read from text starts again.
    assert step(model, collider.Plan.from_string(plan.to_string()), ids, keep).checked == 1


def test_a_checked_step_gives_the_unchecked_gradient():
    model = PatternLM("none")
    ids, keep = batch(3, 0.25, seed=5)
    checked = grads_of(model, ids, keep, "filter", plan=plan_for(model))
    model.zero_grad(set_to_none=True)
    loss = masked_loss(model, ids, keep)
    collider.filter_backward(loss, keep, plan_for(model), check_every=0)
    loss.backward()
    assert max_rel(checked, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}) == 0


def test_check_every_must_be_a_count():
    model = PatternLM("none")
    ids, keep = batch(3, 0.5, seed=1)
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(collider.Error, match="check_every must be an int >= 0"):
            collider.filter_backward(masked_loss(model, ids, keep), keep, plan_for(model), check_every=bad)


def wrong_order_plan(model):
    """The model's plan with the LM head's saved input [B*T, D] cut as if its rows were sequence-major
    ([T, B] flattened) instead of batch-major: every other field as traced."""
    text = plan_for(model).to_string()
    head = re.search(r"^node (\d+) MmBackward0 .*\nfield self_ 0 0 2 0 -1 1 0:1:0:1$", text, flags=re.M)
    assert head, text
    altered = text[:head.end() - len("0:1:0:1")] + "0:3:0:1" + text[head.end():]
    return collider.Plan.from_string(altered), int(head.group(1))


@pytest.mark.parametrize("fresh_run", range(3))
def test_a_wrong_plan_is_refused_on_its_first_step_naming_the_node(fresh_run):
    model = PatternLM("none")
    plan, head = wrong_order_plan(model)
    ids, keep = batch(3, 0.5, seed=10 + fresh_run)
    loss = masked_loss(model, ids, keep)
    with pytest.raises(collider.GradientMismatch, match=rf"first at node MmBackward0 \(#{head}\)") as refused:
        collider.filter_backward(loss, keep, plan)
    assert isinstance(refused.value, collider.Error) and len(str(refused.value)) < 400, str(refused.value)
    # The graph is as the forward left it: a plain backward gives the loss_only gradient.
    model.zero_grad(set_to_none=True)
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert max_rel(plain, grads_of(model, ids, keep, "plain")) < 1e-12
    # Unchecked, the same plan gives a silently wrong gradient: what the check is there for.
    model.zero_grad(set_to_none=True)
    loss = masked_loss(model, ids, keep)
    collider.filter_backward(loss, keep, plan, check_every=0)
    loss.backward()
    wrong = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert max_rel(wrong, grads_of(model, ids, keep, "mask", plan=plan_for(model))) > 1e-3


@pytest.mark.parametrize("attention", ["kept_only", "exact_query"])
def test_mask_backward_of_a_broadcast_causal_mask_is_exact_or_refused_at_the_call(attention):
    """OpenAI GPT multiplies its scores by a causal mask buffer [1, 1, T, T] shared by the batch's
    sequences (a broadcast field inside the attention core). mask_backward leaves it as it is (the
    kept_only masking is the probabilities'), so it gives filter_backward's gradient; what it cannot
    mask it refuses at the call with collider.Error, never inside loss.backward()."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel
    import collider.hf as chf
    torch.manual_seed(0)
    cfg = OpenAIGPTConfig(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, attn_implementation="eager")
    model = OpenAIGPTLMHeadModel(cfg).to(torch.float64).train()
    plan = chf.trace_plan(model, loss="per_token")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (3, 37), generator=gen)
    keep = collider.select_tokens(torch.rand(3, 37, generator=gen), 0.5, valid=chf.keep_mask_from_labels(ids))
    out = {}
    for name, call in (("mask", collider.mask_backward), ("filter", collider.filter_backward)):
        model.zero_grad(set_to_none=True)
        loss = chf.masked_mean(chf.token_losses(model(input_ids=ids).logits, ids), keep)
        try:
            call(loss, keep, plan, attention=attention)
        except collider.Error:
            continue  # refused at the call: the graph is as the forward left it
        loss.backward()  # never an error here
        out[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if len(out) == 2:
        assert max_rel(out["filter"], out["mask"]) < 1e-8
