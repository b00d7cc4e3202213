"""A graph that follows the sequence length gets a plan per length (DESIGN.md section 4, `Plan`).

transformers' reference gated delta rule (Qwen3.5's linear attention layers without
flash-linear-attention) loops over chunks of 64 positions in Python, so its graph at T = 70 (two
chunks) is not the graph of the default trace lengths (one chunk). On a tiny Qwen3.5 text model
(one gated delta rule layer, one attention layer, float64, B = 2):
- the default plan is refused at T = 70 with the advice to trace at that length, graph untouched;
- collider.hf.trace_plan(model, seq_len=70) serves T = 70: filter_backward (checked against
  mask_backward on first use) gives mask_backward's gradient, both semantics;
- plans of two lengths merged (Plan.merge) serve both lengths;
- at T = 128, a multiple of the chunk, the scan skips its padding and neither T - 1 nor T + 1 has
  its graph: refused, saying so.
  pytest python/tests/test_plan_per_length.py
"""
import pytest
import torch

import collider
import collider.hf as chf

VOCAB = 97
TOL = 1e-5  # the reference scan computes in float32 whatever the model's dtype


@pytest.fixture(scope="module")
def model():
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().train()


def step(model, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, T), generator=gen)
    keep = collider.select_tokens(torch.rand(2, T, generator=gen), 0.5, valid=chf.keep_mask_from_labels(ids))
    return ids, keep, chf.training_loss(model, ids, ids, keep)


def grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def filtered_matches_masked(model, plan, T: int) -> None:
    for attention in ("kept_only", "exact_query"):
        ids, keep, loss = step(model, T)
        collider.mask_backward(loss, keep, plan, attention=attention)
        loss.backward()
        want = grads(model)
        ids, keep, loss = step(model, T)
        stats = collider.filter_backward(loss, keep, plan, attention=attention, validate=True)
        loss.backward()
        assert stats.nodes_run_whole > 0 and stats.tensors_gathered > 0, stats
        assert max_rel(grads(model), want) < TOL, attention


def test_the_default_plan_is_refused_at_another_chunk_count_with_advice(model):
    plan = chf.trace_plan(model)
    ids, keep, loss = step(model, 70)
    with pytest.raises(collider.Error, match=r"follows the sequence length.*seq_len=T"):
        collider.filter_backward(loss, keep, plan)
    loss.backward()  # the graph is untouched: a plain backward runs
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_a_plan_at_the_steps_length_is_exact(model):
    filtered_matches_masked(model, chf.trace_plan(model, seq_len=70), 70)


def test_plans_of_two_lengths_merged_serve_both(model):
    plan = chf.trace_plan(model, seq_len=70)
    plan.merge(chf.trace_plan(model, seq_len=150))
    for T in (70, 150):
        filtered_matches_masked(model, plan, T)


def test_a_length_no_neighbour_shares_is_refused(model):
    with pytest.raises(collider.Error, match="neither that at T - 1 nor at T \\+ 1"):
        chf.trace_plan(model, seq_len=128)
    with pytest.raises(collider.Error, match="seq_len must be an int"):
        chf.trace_plan(model, seq_len=2)
