"""Collider's gradients on transformers' own model code against the independent oracle (oracle.py).

Grid: LlamaForCausalLM (GQA), Qwen2ForCausalLM (QKV bias, tied head), PhiForCausalLM (partial
rotary, parallel block); attn_implementation eager and sdpa; both attention semantics;
filter_ratio 0.25 and 0.5; batch 1 and 3; T = 37 (odd); both loss forms: the per-token loss
(collider.hf.token_losses + masked_mean, plan from collider.hf.trace_plan) and transformers' own
model(input_ids, labels=labels).loss with dropped labels -100 (plan from collider.trace_plan on
that call). Tiny random models in train() mode, float64: max relative difference <= 1e-4 over all
parameter gradients (transformers' eager softmax and Collider's SDPA replacement node compute in
fp32, so the differences are at fp32 level). filter_ratio 0 equals a plain backward.
  pytest python/tests/test_hf_gradients.py
"""
import functools

import pytest
import torch

import collider
import collider.hf as chf
from oracle import FAMILIES, grads, max_rel_diff, oracle_keep, tiny_model

T = 37
TOL = 1e-4
LOSS_FORMS = ("per_token", "hf_labels")


@functools.lru_cache(maxsize=None)
def model_for(family: str, attn: str):
    return tiny_model(family, attn)


def step_loss(model, form: str, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    if form == "per_token":
        return chf.masked_mean(chf.token_losses(model(input_ids=ids, use_cache=False).logits, ids), keep)
    return model(input_ids=ids, labels=chf.drop_labels(ids, keep), use_cache=False).loss


@functools.lru_cache(maxsize=None)
def plan_for(family: str, attn: str, form: str) -> collider.Plan:
    model = model_for(family, attn)
    if form == "per_token":
        return chf.trace_plan(model, loss="per_token")
    gen = torch.Generator().manual_seed(1)

    def loss_on_random_batch(batch, seq_len):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return collider.trace_plan(loss_on_random_batch)


def batch_and_mask(batch: int, filter_ratio: float, seed: int, seq_len: int = T):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq_len), generator=gen)
    valid = chf.keep_mask_from_labels(ids)  # the last position predicts nothing
    keep = collider.select_tokens(torch.rand(batch, seq_len, generator=gen), filter_ratio, valid=valid)
    return ids, keep


def ragged_batch(seed: int):
    """B = 3 rows with different kept counts (RHO-1's batch_topk at 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (3, T), generator=gen)
    keep = collider.select_tokens(torch.rand(3, T, generator=gen), 0.5, valid=chf.keep_mask_from_labels(ids),
                                  policy="batch_topk")
    assert len(set(keep.sum(1).tolist())) > 1
    return ids, keep


def collider_grads(model, plan, form, ids, keep, attention):
    model.zero_grad(set_to_none=True)
    loss = step_loss(model, form, ids, keep)
    stats = collider.filter_backward(loss, keep, plan, attention=attention)
    loss.backward()
    return grads(model), loss.detach(), stats


def oracle_grads(model, form, ids, keep, attention):
    model.zero_grad(set_to_none=True)
    with oracle_keep(model, keep, attention):
        loss = step_loss(model, form, ids, keep)
        loss.backward()
    return grads(model), loss.detach()


def plain_grads(model, form, ids, keep):
    model.zero_grad(set_to_none=True)
    loss = step_loss(model, form, ids, keep)
    loss.backward()
    return grads(model), loss.detach()


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_oracle(family, attn, form):
    """Every (semantics, filter_ratio, batch) point of one model / attention / loss form."""
    model = model_for(family, attn)
    plan = plan_for(family, attn, form)
    worst = {}
    for attention in ("kept_only", "exact_query"):
        for ratio in (0.25, 0.5):
            for batch in (1, 3):
                ids, keep = batch_and_mask(batch, ratio, seed=batch * 100 + int(ratio * 100))
                n_kept = int(keep[0].sum())
                assert bool((keep.sum(1) == n_kept).all()) and 0 < n_kept < T - 1
                got, loss_c, stats = collider_grads(model, plan, form, ids, keep, attention)
                assert stats.kept == n_kept and stats.seq_len == T and stats.batch == batch
                assert stats.tensors_gathered > 0
                ref, loss_o = oracle_grads(model, form, ids, keep, attention)
                # the forward is never changed (the oracle's softmax runs in fp32, as transformers' eager one)
                torch.testing.assert_close(loss_c, loss_o, rtol=1e-6, atol=0)
                worst[(attention, ratio, batch)] = max_rel_diff(got, ref)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{family}/{attn}/{form}: max relative gradient difference above {TOL}: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_long_sequence_sdpa_matches_oracle(family):
    """T = 397, so the CPU paths of the fused attention replacement (collider_core/src/sdpa.cpp) run on
    several blocks: exact_query's fused backward in chunks of kept queries (128 or more of them),
    kept_only's blocked GEMMs (64 query rows a block), per-sequence (238 kept per row) and ragged
    (batch_topk: rows keep different counts, padding spread over several blocks)."""
    seq_len = 397
    model = model_for(family, "sdpa")
    plan = plan_for(family, "sdpa", "per_token")
    ids, keep = batch_and_mask(2, 0.4, seed=7, seq_len=seq_len)
    gen = torch.Generator().manual_seed(8)
    scores = torch.rand(2, seq_len, generator=gen)
    scores[1] += torch.linspace(0, 0.5, seq_len)  # row 1 keeps more, later positions most
    ragged = collider.select_tokens(scores, 0.4, policy="batch_topk", valid=chf.keep_mask_from_labels(ids))
    counts = ragged.sum(1).tolist()
    assert counts[0] < counts[1] - 64 and counts[0] >= 128, counts
    worst = {}
    for name, mask in (("per_sequence", keep), ("ragged", ragged)):
        for attention in ("kept_only", "exact_query"):
            got, loss_c, stats = collider_grads(model, plan, "per_token", ids, mask, attention)
            assert stats.kept_total == int(mask.sum()) and stats.seq_len == seq_len
            ref, loss_o = oracle_grads(model, "per_token", ids, mask, attention)
            torch.testing.assert_close(loss_c, loss_o, rtol=1e-6, atol=0)
            worst[(name, attention)] = max_rel_diff(got, ref)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{family}/sdpa T={seq_len}: max relative gradient difference above {TOL}: {bad}"


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_is_plain_backward(family, attn, form):
    model = model_for(family, attn)
    plan = plan_for(family, attn, form)
    for attention in ("kept_only", "exact_query"):
        for batch in (1, 3):
            ids, keep = batch_and_mask(batch, 0.0, seed=7 + batch)
            assert bool((keep == chf.keep_mask_from_labels(ids)).all())
            got, _, _ = collider_grads(model, plan, form, ids, keep, attention)
            ref, _ = plain_grads(model, form, ids, keep)
            assert max_rel_diff(got, ref) <= TOL, (attention, batch)


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_tells_semantics_apart(family):
    """The oracle test would prove nothing if the semantics gave the same gradients here."""
    model = model_for(family, "eager")
    ids, keep = batch_and_mask(3, 0.5, seed=11)
    kept_only, _ = oracle_grads(model, "per_token", ids, keep, "kept_only")
    exact, _ = oracle_grads(model, "per_token", ids, keep, "exact_query")
    dense, _ = plain_grads(model, "per_token", ids, keep)
    assert max_rel_diff(kept_only, exact) > 1e-3
    assert max_rel_diff(exact, dense) > 1e-3


def test_both_loss_forms_agree():
    """transformers' own loss with dropped labels -100 is the per-token masked mean."""
    model = model_for("llama", "eager")
    ids, keep = batch_and_mask(3, 0.5, seed=5)
    with torch.no_grad():
        a = step_loss(model, "per_token", ids, keep)
        b = step_loss(model, "hf_labels", ids, keep)
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=0)  # transformers' loss runs in fp32


def test_mask_backward_matches_filter_backward():
    model = model_for("llama", "eager")
    plan = plan_for("llama", "eager", "per_token")
    ids, keep = batch_and_mask(3, 0.25, seed=3)
    for attention in ("kept_only", "exact_query"):
        got, _, _ = collider_grads(model, plan, "per_token", ids, keep, attention)
        model.zero_grad(set_to_none=True)
        loss = step_loss(model, "per_token", ids, keep)
        collider.mask_backward(loss, keep, plan, attention=attention)
        loss.backward()
        assert max_rel_diff(got, grads(model)) <= TOL


def node_names(loss: torch.Tensor) -> list:
    """The names of the autograd nodes reachable from the loss."""
    seen, stack, names = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack += [edge[0] for edge in node.next_functions]
    return names


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_batch_topk_matches_oracle(family, attn, form):
    """RHO-1's own batch_topk selection: rows keep different counts (one row keeps none). Under
    eager attention every attention core runs row by row (no softmax backward left)."""
    model = model_for(family, attn)
    plan = plan_for(family, attn, form)
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(0, 128, (3, T), generator=gen)
    scores = torch.rand(3, T, generator=gen)
    scores[1] -= 2.0  # row 1 scores lowest: it keeps nothing at filter_ratio 0.6
    scores[2] += torch.linspace(0, 1, T)  # row 2 keeps more than row 0
    keep = collider.select_tokens(scores, 0.6, policy="batch_topk", valid=chf.keep_mask_from_labels(ids))
    counts = keep.sum(1).tolist()
    assert counts[1] == 0 and counts[0] != counts[2], counts
    for attention in ("kept_only", "exact_query"):
        got, _, stats = collider_grads(model, plan, form, ids, keep, attention)
        assert (stats.kept_min, stats.kept_max, stats.kept_total) == (0, max(counts), sum(counts))
        ref, _ = oracle_grads(model, form, ids, keep, attention)
        assert max_rel_diff(got, ref) <= TOL, attention
        if attn == "eager":
            loss = step_loss(model, form, ids, keep)
            collider.filter_backward(loss, keep, plan, attention=attention)
            names = node_names(loss)
            assert "collider::RowAttention" in names and "SoftmaxBackward0" not in names, attention
            model.zero_grad(set_to_none=True)


def padded_or_packed_batch(layout: str, seed: int):
    """Right padding (attention_mask zeros at the end of two rows, their labels -100) or packed rows
    (two documents per row, position_ids restarting in the middle). Returns the forward's keyword
    arguments, the labels and a batch_topk keep mask over the labelled positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (3, T), generator=gen)
    kwargs, labels = {}, ids
    if layout == "right_padding":
        mask = torch.ones(3, T, dtype=torch.long)
        mask[1, T - 8:] = 0
        mask[2, T - 3:] = 0
        kwargs["attention_mask"] = mask
        labels = ids.masked_fill(mask == 0, -100)
    else:
        pos = torch.arange(T).repeat(3, 1)
        pos[:, T // 2:] -= T // 2
        kwargs["position_ids"] = pos
    keep = collider.select_tokens(torch.rand(3, T, generator=gen), 0.4, policy="batch_topk",
                                  valid=chf.keep_mask_from_labels(labels))
    return ids, kwargs, labels, keep


@pytest.mark.parametrize("layout", ["right_padding", "packed_position_ids"])
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_and_packed_rows_under_eager_match_oracle(family, layout):
    """Eager attention takes transformers' mask (padding, or document boundaries from position_ids)
    as an ordinary tensor, so these batches filter exactly; the oracle gets the same mask."""
    model = model_for(family, "eager")
    ids, kwargs, labels, keep = padded_or_packed_batch(layout, seed=21)

    def loss_of(x, kw, lab, k):
        return chf.masked_mean(chf.token_losses(model(input_ids=x, use_cache=False, **kw).logits, lab), k)

    def loss_on_random_batch(b, t):
        x = torch.randint(0, 128, (b, t))
        kw = {"attention_mask": torch.ones(b, t, dtype=torch.long)} if layout == "right_padding" else {
            "position_ids": torch.arange(t).repeat(b, 1)}
        return loss_of(x, kw, x, chf.keep_mask_from_labels(x))

    plan = collider.trace_plan(loss_on_random_batch)
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = loss_of(ids, kwargs, labels, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        got = grads(model)
        model.zero_grad(set_to_none=True)
        with oracle_keep(model, keep, attention):
            loss_of(ids, kwargs, labels, keep).backward()
        assert max_rel_diff(got, grads(model)) <= TOL, (layout, attention)
