"""Collider's fused LM head from Python (collider.score_head, collider.fused_head_loss) and through
collider.hf (loss form "fused_head"), against the unfused head, in float64:
  - alone: loss, token losses and entropy equal to a cross-entropy over the full logits; the
    gradients of hidden states, weight and bias equal to plain autograd's of the kept rows' loss
    (a keep mask chosen from the head's own scores, ragged, a row that keeps nothing, ignore_index,
    tied weights, soft-capping);
  - transformers Llama (GQA), Qwen2 (tied head) and Gemma2 (final logit soft-capping) through
    collider.hf: the fused form's loss and Collider gradient equal to the per-token form's (the
    model's logits, token_losses, the same mean over the kept tokens; transformers' own loss upcasts
    float64 logits to float32) under Collider, and to the oracle
    (collider.mask_backward), both semantics, eager and SDPA, B = 3, equal and ragged masks;
  - a head whose model does more to its logits is refused before any step;
  - Rho1Trainer(fused_head=True): the same parameters after two steps as the unfused trainer.
  pytest python/tests/test_head.py
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, tiny_model
from test_hf_trainer import Windows

T = 29


def unfused(x, w, b, target, keep, softcap=None, divisor=1.0):
    z = x @ w.t()
    if b is not None:
        z = z + b
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    logp = torch.log_softmax(z, -1)
    tok = F.nll_loss(logp.reshape(-1, w.shape[0]), target.reshape(-1), reduction="none").view(target.shape)
    return (tok * keep).sum() / divisor, tok, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("softcap,bias,chunks", [(None, False, (5, 7)), (2.5, True, (64, 3)), (None, True, (1, 1))])
def test_head_alone_equals_the_unfused_head(softcap, bias, chunks):
    g = torch.Generator().manual_seed(0)
    B, V, D = 3, 31, 6
    x = torch.randn(B, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    target = torch.randint(0, V, (B, T), generator=g)
    target[:, -1] = -100
    scored = collider.score_head(x, w, target, b, softcap=softcap, entropy=True, chunk_rows=chunks[0],
                                 chunk_vocab=chunks[1])
    assert not scored.token_loss.requires_grad
    # RHO-1's order: the keep mask from the head's own scores; row 2 keeps nothing.
    keep = collider.select_tokens(scored.token_loss, 0.5, policy="batch_topk", valid=target != -100)
    keep[2] = False
    params = [x, w] + ([b] if bias else [])
    loss = scored.loss(keep, 7.0)
    got = torch.autograd.grad(loss, params)
    ref_loss, ref_tok, ref_ent = unfused(x, w, b, target, keep, softcap, 7.0)
    ref = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scored.token_loss, ref_tok.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scored.entropy, ref_ent.detach(), rtol=1e-12, atol=1e-12)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-12)
    assert float(got[0][2].abs().max()) == 0.0  # the row that keeps nothing


def test_fused_head_loss_tied_weights_equal_plain_autograd():
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(23, 8).double()
    ids = torch.randint(0, 23, (2, T), generator=g)
    hidden = torch.tanh(emb(ids))
    target = chf.shift_labels(ids)
    res = collider.fused_head_loss(hidden, emb.weight, target, divisor=3.0, chunk_vocab=5)
    res.loss.backward()
    mine = emb.weight.grad.clone()
    emb.weight.grad = None
    ref = F.cross_entropy(torch.tanh(emb(ids)) .reshape(-1, 8) @ emb.weight.t(), target.reshape(-1),
                          reduction="sum") / 3.0
    ref.backward()
    torch.testing.assert_close(res.loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine, emb.weight.grad, rtol=1e-11, atol=1e-12)
    assert res.entropy is None


def test_fused_head_says_which_way_it_takes():
    # Blocks of 1024 x 8192 logits: 262 whole-vocabulary rows at V = 32000 (gradient in the forward),
    # 55 at V = 151936 (recompute), unless one block holds every row.
    assert not collider.fused_head_recomputes(2048, 32000)
    assert collider.fused_head_recomputes(2048, 151936)
    assert not collider.fused_head_recomputes(40, 151936)
    assert not collider.fused_head_recomputes(2048, 151936, chunk_vocab=256 * 151936 // 1024)
    assert collider.fused_head_recomputes(2048, 32000, recompute=True)


def test_bad_arguments_are_refused():
    x, w = torch.randn(4, 3), torch.randn(7, 3)
    with pytest.raises(collider.Error, match=r"\[0, 7\)"):
        collider.fused_head_loss(x, w, torch.full((4,), 9))
    with pytest.raises(collider.Error, match="keep must be bool"):
        collider.fused_head_loss(x, w, torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(collider.Error, match="must be a torch.Tensor"):
        collider.score_head(x, [1.0], torch.zeros(4, dtype=torch.long))


FAMILIES = ("llama", "qwen2", "gemma2")


@functools.lru_cache(maxsize=None)
def model_for(family, attn):
    return tiny_model(family, attn)


@functools.lru_cache(maxsize=None)
def plan_for(family, attn, form):
    return chf.trace_plan(model_for(family, attn), loss=form)


def batch(seed, ragged):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (3, T), generator=g)
    keep = collider.select_tokens(torch.rand(3, T, generator=g), 0.5, valid=chf.keep_mask_from_labels(ids),
                                  policy="batch_topk" if ragged else "per_sequence", align=1)
    return ids, keep


# Gemma2 has no SDPA path in transformers (its attention soft-capping): eager only.
@pytest.mark.parametrize("family,attn", [(f, a) for f in FAMILIES for a in ("eager", "sdpa")
                                         if (f, a) != ("gemma2", "sdpa")])
@pytest.mark.parametrize("attention", ["kept_only", "exact_query"])
@pytest.mark.parametrize("ragged", [False, True], ids=["equal", "ragged"])
def test_hf_fused_form_equals_per_token_form_under_collider(family, attn, attention, ragged):
    model = model_for(family, attn)
    ids, keep = batch(3, ragged)

    def step(form, method):
        model.zero_grad(set_to_none=True)
        loss = chf.training_loss(model, ids, ids, keep, loss=form)
        stats = method(loss, keep, plan_for(family, attn, form), attention=attention)
        loss.backward()
        return loss.detach(), grads(model), stats

    loss_l, g_labels, _ = step("per_token", collider.filter_backward)
    loss_f, g_fused, stats = step("fused_head", collider.filter_backward)
    _, g_oracle, _ = step("fused_head", collider.mask_backward)
    torch.testing.assert_close(loss_f, loss_l, rtol=1e-10, atol=1e-12)
    assert max_rel_diff(g_fused, g_labels) <= 1e-4  # eager softmax and SDPA replacements at fp32 level
    assert max_rel_diff(g_fused, g_oracle) <= 1e-4
    assert stats.nodes_rewritten > 0


def test_hf_head_that_does_more_is_refused():
    model = tiny_model("llama", "eager", seed=4)
    ids, keep = batch(5, False)
    orig = model.forward

    def scaled_forward(*args, **kwargs):  # a CausalLM whose logits are not just lm_head's
        out = orig(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled_forward
    with pytest.raises(collider.Error, match="does not reproduce"):
        chf.training_loss(model, ids, ids, keep, loss="fused_head")
    with pytest.raises(collider.Error, match="computes no logits"):
        chf.training_loss(model, ids, ids, keep, loss="fused_head", logits=torch.zeros(3, T, 128))


def test_rho1_trainer_fused_head_trains_like_the_unfused_one(tmp_path):
    transformers = pytest.importorskip("transformers")

    def train(fused):
        model = tiny_model("qwen2", "sdpa", seed=2)
        ref = tiny_model("qwen2", "sdpa", seed=3)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(fused)), per_device_train_batch_size=4,
                                              max_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                                              save_strategy="no", logging_steps=1, disable_tqdm=True,
                                              dataloader_num_workers=0, seed=0)
        trainer = chf.Rho1Trainer(model=model, reference_model=ref, args=args, train_dataset=Windows(8, seed=7),
                                  filter_ratio=0.5, attention="exact_query", fused_head=fused,
                                  loss="labels" if fused else "per_token")  # per_token: float64 logits
        trainer.train()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.last_keep_mask

    plain, keep_plain = train(False)
    fused, keep_fused = train(True)
    assert torch.equal(keep_plain, keep_fused)
    assert max_rel_diff(fused, plain) <= 1e-9
