"""Padded and packed batches, and sliding windows, under SDPA: the fused attention's explicit mask.

transformers passes scaled_dot_product_attention an explicit mask for padded rows, for packed rows
(documents restarting their position_ids, or a block-diagonal 4D mask given by the caller) and for
sliding windows; Collider's replacement of the SDPA backward cuts that mask like the scores
(collider_core/src/sdpa.cpp). Against the oracle (oracle.py), which gets the same mask from
transformers: tiny random Llama and Qwen2 (grouped-query attention, float64), sdpa, both semantics,
B = 3, T = 37, filter ratios 0.25 and 0.5 (per-sequence where every row has the same number of
labelled positions, RHO-1's batch_topk always); T = 397 for the CPU's blocked and chunked paths
(left padding, packed rows, a 64-position window); Mistral with sliding_window 16 < T and Gemma3
(alternating sliding and global layers), sdpa and eager. Max relative difference <= 1e-4. The plans
come from collider.hf.trace_plan (traced with and without a mask, merged), or from a trace on
unmasked batches merged with one on masked batches.
  pytest python/tests/test_masks.py
"""
import pytest
import torch

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, oracle_keep, tiny_model

TOL = 1e-4
LAYOUTS = ("right_padding", "left_padding", "packed_position_ids", "block_diagonal_mask")


def masked_batch(layout: str, B: int, T: int, seed: int):
    """input_ids, the forward's extra arguments and the labels (-100 where nothing is predicted)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (B, T), generator=gen)
    kwargs, labels = {}, ids.clone()
    cut = max(3, T * 2 // 5)  # where the second document starts / how much padding
    if layout in ("right_padding", "left_padding"):
        mask = torch.ones(B, T, dtype=torch.long)
        for b in range(1, B):
            pad = cut // b
            if layout == "right_padding":
                mask[b, T - pad:] = 0
            else:
                mask[b, :pad] = 0
        kwargs["attention_mask"] = mask
        labels = ids.masked_fill(mask == 0, -100)
    elif layout == "packed_position_ids":
        pos = torch.arange(T).repeat(B, 1)
        pos[:, cut:] -= cut
        kwargs["position_ids"] = pos
        labels[:, cut] = -100  # a document's first token is not predicted from the one before
    elif layout == "block_diagonal_mask":
        doc = (torch.arange(T) >= cut).long().repeat(B, 1)
        doc[0, T - cut // 2:] = 2  # three documents in row 0
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        kwargs["attention_mask"] = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # [B, 1, T, T]
        labels[:, cut] = -100
    else:
        raise ValueError(layout)
    return ids, kwargs, labels


def loss_of(model, ids, kwargs, labels, keep):
    return chf.masked_mean(chf.token_losses(model(input_ids=ids, use_cache=False, **kwargs).logits, labels), keep)


def check(model, plan, ids, kwargs, labels, keep, label):
    worst = {}
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, ids, kwargs, labels, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        got = grads(model)
        model.zero_grad(set_to_none=True)
        with oracle_keep(model, keep, attention):
            loss_of(model, ids, kwargs, labels, keep).backward()
        worst[attention] = max_rel_diff(got, grads(model))
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{label}: max relative gradient difference above {TOL}: {bad}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sdpa_with_a_mask_matches_oracle(family, layout):
    model = tiny_model(family, "sdpa")
    plan = chf.trace_plan(model, loss="per_token")
    assert plan.num_variants >= 2
    ids, kwargs, labels = masked_batch(layout, 3, 37, seed=11)
    valid = chf.keep_mask_from_labels(labels)
    gen = torch.Generator().manual_seed(12)
    policies = ("batch_topk",) if "padding" in layout else ("per_sequence", "batch_topk")
    for policy in policies:
        for ratio in (0.25, 0.5):
            keep = collider.select_tokens(torch.rand(3, 37, generator=gen), ratio, policy=policy, valid=valid)
            check(model, plan, ids, kwargs, labels, keep, f"{family}/{layout}/{policy}/{ratio}")


@pytest.mark.parametrize("layout", ["left_padding", "packed_position_ids", "sliding_window_mask"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_long_masked_sequences_match_oracle(family, layout):
    """T = 397: the CPU paths work on blocks of kept query rows and skip the keys a block's mask
    closes (the other document, the positions out of the window)."""
    T = 397
    model = tiny_model(family, "sdpa", max_position_embeddings=512)
    plan = chf.trace_plan(model, loss="per_token")
    if layout == "sliding_window_mask":
        ids, kwargs, labels = masked_batch("right_padding", 2, T, seed=13)
        i = torch.arange(T)
        window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 64)
        kwargs = {"attention_mask": window[None, None].expand(2, 1, T, T)}
        labels = ids
    else:
        ids, kwargs, labels = masked_batch(layout, 2, T, seed=13)
    keep = collider.select_tokens(torch.rand(2, T, generator=torch.Generator().manual_seed(14)), 0.4,
                                  policy="batch_topk", valid=chf.keep_mask_from_labels(labels))
    check(model, plan, ids, kwargs, labels, keep, f"{family}/{layout}/T={T}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_models_match_oracle(family, attn):
    model = tiny_model(family, attn)
    plan = chf.trace_plan(model, loss="per_token")
    gen = torch.Generator().manual_seed(15)
    ids = torch.randint(0, 128, (3, 37), generator=gen)
    for ratio in (0.25, 0.5):
        keep = collider.select_tokens(torch.rand(3, 37, generator=gen), ratio, valid=chf.keep_mask_from_labels(ids))
        check(model, plan, ids, {}, ids, keep, f"{family}/{attn}/{ratio}")


def test_a_plan_of_unmasked_batches_merges_one_of_masked_batches():
    """collider.trace_plan on plain batches, then merged with a trace on padded ones: the plan serves
    both (transformers' SDPA with grouped-query attention takes another graph when it passes a mask)."""
    model = tiny_model("llama", "sdpa")

    def traced(padded):
        def loss_on_random_batch(b, t):
            x = torch.randint(0, 128, (b, t))
            kw = {}
            if padded:
                kw["attention_mask"] = torch.ones(b, t, dtype=torch.long)
                kw["attention_mask"][0, -1] = 0
            return loss_of(model, x, kw, x, chf.keep_mask_from_labels(x))
        return collider.trace_plan(loss_on_random_batch)

    plain = traced(False)
    ids, kwargs, labels = masked_batch("right_padding", 3, 37, seed=16)
    keep = collider.select_tokens(torch.rand(3, 37), 0.4, policy="batch_topk", valid=chf.keep_mask_from_labels(labels))
    with pytest.raises(collider.Error, match="does not match the plan"):
        collider.filter_backward(loss_of(model, ids, kwargs, labels, keep), keep, plain)
    plain.merge(traced(True))
    assert plain.num_variants == 4 and "4 traced variants" in plain.summary()
    check(model, plain, ids, kwargs, labels, keep, "merged plan, padded batch")
    unmasked_keep = collider.select_tokens(torch.rand(3, 37), 0.4, valid=chf.keep_mask_from_labels(ids))
    check(model, plain, ids, {}, ids, unmasked_keep, "merged plan, plain batch")
    restored = collider.Plan.from_string(plain.to_string())
    assert restored.num_variants == 4
