"""Collider on encoder-decoder models: the tokens are the decoder's positions, the encoder's source is a
second sequence whose rows are never cut, whatever its length.

Models (transformers' own code, tiny random configs built here, float64, train() mode): BART, T5 (its
relative position biases learned, which trace_plan refuses, and frozen) and the generic
EncoderDecoderModel (BERT to BERT, the decoder's cross-attention added);
attn_implementation eager and sdpa; the source as long as the target (both padded to one length: every
size of the encoder then equals the token length) and of another length; both semantics; batch 3; the
check on first use on (the default) and off (check_every=0). Oracle: the models' attention with the keep
mask applied to the decoder's own self-attention only (its dropped keys and values detached; under
kept_only its dropped key columns too, oracle.py's semantics); the encoder's self-attention and the
cross-attention from the decoder to the encoder are plain autograd (the source is not the tokens: its
rows are all kept, the cross-attention's keys and values are exact).

Every step must be exact (max relative gradient difference <= 1e-6) or refused by collider with its
typed collider.Error, at trace_plan or at filter_backward, before loss.backward() (which then gives the
loss_only gradient): never a wrong gradient, never an error inside loss.backward(). Under eager attention
every step of BART, T5 (its bias frozen) and BERT to BERT is exact, the check on first use on or off;
SDPA's fused cross-attention is exact too: replaced by one over the kept queries and every source key.
  pytest python/tests/test_encoder_decoder.py
"""
import collections
import contextlib
import functools

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import collider
from oracle import grads

T = 29          # the target (token) length of the steps
OTHER_S = 11    # a source of another length (traces and steps)
B = 3
TOL = 1e-6
FAMILIES = ("bart", "t5", "t5_frozen_bias", "bert2bert")

ORACLE = "collider_encdec_oracle"
_state = {"keep": None, "attention": None, "modules": frozenset(), "calls": 0}


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_bias=None,
                     **kwargs):
    """query [B, H, Tq, E], key/value [B, H, Tk, E] -> (output [B, Tq, H, E], probabilities). Eager
    attention (T5's position bias added to the scores); the keep mask applies only where `module` is
    one of the decoder's self-attentions."""
    if dropout:
        raise RuntimeError("the oracle supports attention dropout 0 only")
    tokens = id(module) in _state["modules"]
    keep = _state["keep"]
    if tokens:
        _state["calls"] += 1
        m_kv = keep[:, None, :, None]  # [B, 1, T, 1]
        key = torch.where(m_kv, key, key.detach())
        value = torch.where(m_kv, value, value.detach())
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query, key.transpose(2, 3)) * scale  # [B, H, Tq, Tk]
    if position_bias is not None:
        s = s + position_bias
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool else s + attention_mask
    m_col = keep[:, None, None, :] if tokens else None  # [B, 1, 1, T]
    if tokens and _state["attention"] == "kept_only":
        s = torch.where(m_col, s, s.detach())
    p = torch.softmax(s, dim=-1)  # in the model's dtype, as these models' eager attention
    if tokens and _state["attention"] == "kept_only":
        p = torch.where(m_col, p, p.detach())
    return torch.matmul(p, value).transpose(1, 2).contiguous(), p


AttentionInterface.register(ORACLE, oracle_attention)
AttentionMaskInterface.register(ORACLE, eager_mask)


def decoder_self_attentions(family: str, model) -> list:
    """The attention modules of the decoder's own self-attention (not the cross-attention)."""
    if family == "bart":
        return [layer.self_attn for layer in model.model.decoder.layers]
    if family.startswith("t5"):
        return [block.layer[0].SelfAttention for block in model.decoder.block]
    return [layer.attention.self for layer in model.decoder.bert.encoder.layer]


def set_attention(model, name: str):
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = name


@contextlib.contextmanager
def oracle(family: str, model, keep: torch.Tensor, attention: str):
    before = model.config._attn_implementation
    model.set_attn_implementation(ORACLE)
    _state.update(keep=keep, attention=attention, calls=0,
                  modules=frozenset(id(m) for m in decoder_self_attentions(family, model)))
    try:
        yield
        assert _state["calls"] > 0, "the oracle was never called for the decoder's self-attention"
    finally:
        _state.update(keep=None, attention=None, modules=frozenset())
        model.set_attn_implementation(before)


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, attn: str):
    torch.manual_seed(0)
    if family == "bart":
        from transformers import BartConfig, BartForConditionalGeneration
        cfg = BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=128, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         init_std=0.2, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                         use_cache=False, attn_implementation=attn)
        model = BartForConditionalGeneration(cfg)
    elif family.startswith("t5"):
        from transformers import T5Config, T5ForConditionalGeneration
        cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                       relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                       feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                       use_cache=False, attn_implementation=attn)
        model = T5ForConditionalGeneration(cfg)
        if family == "t5_frozen_bias":  # what collider's refusal of the learned one advises
            for name, p in model.named_parameters():
                p.requires_grad_("relative_attention_bias" not in name)
    else:
        from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel
        common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, initializer_range=0.2, attn_implementation=attn)
        encoder = BertModel(BertConfig(**common), add_pooling_layer=False)
        decoder = BertLMHeadModel(BertConfig(is_decoder=True, add_cross_attention=True, **common))
        model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
        model.config.decoder_start_token_id = 2
        model.config.pad_token_id = 0
    model = model.to(torch.float64)
    model.train()
    set_attention(model, attn)
    return model


def source_length(source: str, seq_len: int) -> int:
    return seq_len if source == "same" else OTHER_S


def step_loss(model, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=tgt, labels=labels,
                 use_cache=False).loss


def trace(model, source: str) -> collider.Plan:
    gen = torch.Generator().manual_seed(1)

    def loss_on_random_batch(batch, seq_len):
        src = torch.randint(3, 128, (batch, source_length(source, seq_len)), generator=gen)
        tgt = torch.randint(3, 128, (batch, seq_len), generator=gen)
        return step_loss(model, src, tgt, tgt)

    return collider.trace_plan(loss_on_random_batch)


def batch_and_mask(source: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 128, (B, source_length(source, T)), generator=gen)
    tgt = torch.randint(3, 128, (B, T), generator=gen)
    labels = torch.randint(3, 128, (B, T), generator=gen)
    keep = collider.select_tokens(torch.rand(B, T, generator=gen), 0.5)
    return src, tgt, labels, keep


def max_rel_diff(got: dict, ref: dict) -> float:
    """max over parameters of max|got - ref| / max(max|ref|, 1e-6 * the largest gradient entry of all): a
    parameter whose true gradient is zero (a key bias: softmax ignores a constant per row) holds rounding
    noise on both sides, which counts against the largest gradient, not against itself."""
    assert got.keys() == ref.keys(), f"different gradient sets: {sorted(set(got) ^ set(ref))}"
    largest = max(r.abs().max().item() for r in ref.values())
    worst = 0.0
    for k in ref:
        if not (bool(torch.isfinite(got[k]).all()) and bool(torch.isfinite(ref[k]).all())):
            return float("inf")
        worst = max(worst, (got[k] - ref[k]).abs().max().item() / max(ref[k].abs().max().item(), 1e-6 * largest))
    return worst


def dropped(labels, keep):
    return labels.masked_fill(~keep, -100)


def run_step(family, model, plan, source, attention, check_every, seed):
    """One step: "exact", or "refused" (collider.Error at filter_backward), with its measured difference."""
    src, tgt, labels, keep = batch_and_mask(source, seed)
    model.zero_grad(set_to_none=True)
    with oracle(family, model, keep, attention):
        step_loss(model, src, tgt, dropped(labels, keep)).backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    loss = step_loss(model, src, tgt, dropped(labels, keep))
    try:
        collider.filter_backward(loss, keep, plan, attention=attention, check_every=check_every)
    except collider.Error as e:
        return "refused", str(e)
    loss.backward()  # an error here fails the test: a step must be refused at the call, never inside backward
    return "exact" if max_rel_diff(grads(model), ref) <= TOL else "wrong", max_rel_diff(grads(model), ref)


# Where every step must be exact (the others may be refused, never wrong): eager attention, which
# collider cuts along the decoder's query rows only where the keys are the source, and SDPA, whose fused
# cross-attention it replaces by one over the kept queries and every source key.
EXACT = {(f, attn) for f in ("bart", "t5_frozen_bias", "bert2bert") for attn in ("eager", "sdpa")}


@pytest.mark.parametrize("check_every", [collider.DEFAULT_CHECK_EVERY, 0], ids=["check", "nocheck"])
@pytest.mark.parametrize("source", ["same", "other"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_or_refused(family, attn, source, check_every):
    """Every step exact or refused before backward, both semantics; the source is never cut. With the
    check on first use on, an exact step is not refused (its key biases' true gradient is zero: rounding
    noise on both sides)."""
    model = tiny_model(family, attn)
    try:
        plan = trace(model, source)
    except collider.Error as e:
        assert (family, attn) not in EXACT, f"refused at trace_plan: {e}"
        return  # a refusal is allowed; a wrong gradient never is
    outcomes = {}
    for attention in ("kept_only", "exact_query"):
        for seed in (1, 2):
            outcomes[(attention, seed)] = run_step(family, model, plan, source, attention, check_every, seed)
    wrong = {k: v for k, v in outcomes.items() if v[0] == "wrong"}
    assert not wrong, f"{family}/{attn}/source {source}: wrong gradients accepted: {wrong}"
    if (family, attn) in EXACT:
        refused = {k: v for k, v in outcomes.items() if v[0] != "exact"}
        assert not refused, f"{family}/{attn}/source {source}: refused: {refused}"


@pytest.mark.parametrize("source", ["same", "other"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "t5"])
def test_a_fused_cross_attention_keeps_every_source_key(family, source):
    """SDPA's fused cross-attention is planned as one (query rows cut, keys whole), whatever the source's
    length; the encoder's own fused self-attention is not cut at all."""
    plan = trace(tiny_model(family, "sdpa"), source)
    nodes = [line.split() for line in plan.to_string().splitlines() if line.startswith("node ")]
    fused = [n for n in nodes if "ScaledDotProduct" in n[2]]
    kinds = collections.Counter(int(n[3]) for n in fused)  # 0 not cut (the encoder's), 2 self-, 3 cross-attention
    assert set(kinds) == {0, 2, 3} and len(set(kinds.values())) == 1, kinds  # as many of each (per plan variant)


@pytest.mark.parametrize("source", ["same", "other"])
def test_a_learned_relative_position_bias_is_refused_at_trace_plan_saying_what_to_do(source):
    """T5's relative position bias [1, H, T, T] is shared by the batch's sequences and learned over query and
    key positions: no per-sequence cut keeps it shared, so trace_plan refuses it, advising to freeze it;
    frozen, every step is exact (test_exact_or_refused, family t5_frozen_bias)."""
    with pytest.raises(collider.Error, match=r"Freeze that bias \(requires_grad_\(False\)\)"):
        trace(tiny_model("t5", "eager"), source)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_learned_prefix_as_long_as_the_tokens_is_refused_at_trace_plan(attn):
    """The other second sequence a decoder takes: PEFT's prefix tuning, learned keys and values concatenated before
    the tokens' own in every attention, here as long as the tokens (num_virtual_tokens = T). Its keys are partly
    the tokens and partly not, which collider does not cut: refused at trace_plan, whatever the step's sizes."""
    from peft import PrefixTuningConfig, get_peft_model
    from oracle import tiny_model as tiny_decoder
    model = get_peft_model(tiny_decoder("llama", attn), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=T))
    gen = torch.Generator().manual_seed(1)

    def loss_on_random_batch(batch, seq_len):
        ids = torch.randint(3, 100, (batch, seq_len), generator=gen)
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    with pytest.raises(collider.Error, match="collider cannot rewrite node"):
        collider.trace_plan(loss_on_random_batch)
