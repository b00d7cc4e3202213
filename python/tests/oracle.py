"""Independent gradient oracle for Collider on transformers models, and the tiny models the tests use.

The oracle is an attention function registered with transformers' AttentionInterface under the
name "collider_oracle": plain autograd math (Q K^T, softmax, P V) in which, for the keep mask set
by `oracle_keep`, (DESIGN.md section 3)
  exact_query: the K and V rows of dropped tokens are detached (dK, dV of dropped rows discarded);
  kept_only:   additionally the scores S and probabilities P of dropped key columns are detached, so
               dP_ij = dO_i . V_j only for kept j, the softmax backward sums over kept columns only,
               and dS_ij = 0 for dropped j: dQ, dK, dV use P restricted to kept rows and columns.
Dropped query rows get no gradient because the masked loss and the detached K/V leave them none.
In an encoder-decoder (config.is_encoder_decoder) the keep mask applies to the decoder's own
self-attention only, found by where the module sits (in the decoder, and not named as a cross-attention),
never by its sizes: the encoder's source is not the tokens (its attention and the cross-attention onto it
are plain autograd).
Attention sinks (GPT-OSS, passed as s_aux) are one more score column per head, never dropped, that
the softmax normalises over and the output leaves out.
It shares no code with collider_core. Used by test_hf_gradients.py, test_hf_trainer.py, test_peft_ddp.py.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

ORACLE = "collider_oracle"
_state = {"keep": None, "attention": None, "calls": 0, "source_modules": None}
# The names transformers gives a decoder's cross-attention modules (BART, T5, BERT, Whisper, ...)
CROSS_ATTENTION_NAMES = ("encoder_attn", "crossattention", "EncDecAttention", "cross_attn", "cross_attention")


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:  # [B, G, T, E] -> [B, G * n_rep, T, E]
    if n_rep == 1:
        return x
    B, G, T, E = x.shape
    return x[:, :, None].expand(B, G, n_rep, T, E).reshape(B, G * n_rep, T, E)


def oracle_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, H, T, E], key/value [B, G, T, E] -> (output [B, T, H, E], probabilities)."""
    keep: Optional[torch.Tensor] = _state["keep"]
    if keep is None:
        raise RuntimeError("oracle attention used outside oracle_keep()")
    if dropout:
        raise RuntimeError("the oracle supports attention dropout 0 only")
    _state["calls"] += 1
    B, H, T, E = query.shape
    # An encoder-decoder's tokens are its decoder's positions: only the decoder's own (causal)
    # self-attention is over them; the encoder's self-attention and the cross-attention onto the
    # source are plain (the source is not the tokens, whatever its length; DESIGN.md section 4).
    tokens = _state["source_modules"] is None or id(module) not in _state["source_modules"]
    if not tokens:
        keep = torch.ones(B, key.shape[2], dtype=torch.bool)
    m_kv = keep.to(key.device)[:, None, :, None]  # [B, 1, T, 1]: kept key/value rows
    key = torch.where(m_kv, key, key.detach())
    value = torch.where(m_kv, value, value.detach())
    k = _repeat_kv(key, H // key.shape[1])
    v = _repeat_kv(value, H // value.shape[1])
    scale = scaling if scaling is not None else E ** -0.5
    s = torch.matmul(query, k.transpose(2, 3)) * scale  # [B, H, T, T]
    softcap = kwargs.get("softcap")
    if softcap is not None:  # Gemma2's logit soft-capping: cap * tanh(s / cap)
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            s = s.masked_fill(~attention_mask, float("-inf"))
        else:
            s = s + attention_mask
    elif getattr(module, "is_causal", True):
        causal = torch.ones(T, T, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
    # A query row the mask closes entirely (left padding) attends to nothing: probabilities 0, as
    # SDPA gives (softmax over a row of -inf would be NaN; transformers' mask uses the dtype's
    # minimum, which becomes -inf in float32).
    closed = (s <= torch.finfo(s.dtype).min / 2).all(-1, keepdim=True)
    s = s.masked_fill(closed, 0.0)
    m_col = keep.to(s.device)[:, None, None, :]  # [B, 1, 1, T]: kept key columns
    sinks = kwargs.get("s_aux")  # GPT-OSS's attention sinks: one more logit per head, a column never dropped
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(B, H, T, 1).to(s.dtype)], dim=-1)
        m_col = torch.cat([m_col, torch.ones_like(m_col[..., :1])], dim=-1)
    if _state["attention"] == "kept_only":
        s = torch.where(m_col, s, s.detach())
    p = torch.softmax(s.float(), dim=-1).to(query.dtype).masked_fill(closed, 0.0)
    if _state["attention"] == "kept_only":
        p = torch.where(m_col, p, p.detach())
    if sinks is not None:
        p = p[..., :-1]
    out = torch.matmul(p, v).transpose(1, 2).contiguous()
    return out, p


AttentionInterface.register(ORACLE, oracle_attention)
# The mask transformers builds for the oracle is eager attention's (an additive [B, 1, T, T] with the
# padding and, for packed rows, the document boundaries): without one registered, a custom attention
# gets no mask at all, and a padded or packed batch would be compared against plain causal attention.
AttentionMaskInterface.register(ORACLE, eager_mask)


def source_attentions(model) -> Optional[frozenset]:
    """ids of the modules of an encoder-decoder whose keys are not the tokens: every module of its encoder,
    and its decoder's cross-attentions (by name, with their sub-modules); None for a model without an encoder."""
    if not getattr(model.config, "is_encoder_decoder", False) or not hasattr(model, "get_encoder"):
        return None
    found = {id(m) for m in model.get_encoder().modules()}
    for name, m in model.named_modules():
        if any(part in CROSS_ATTENTION_NAMES for part in name.split(".")):
            found.add(id(m))
    return frozenset(found)


@contextlib.contextmanager
def oracle_keep(model, keep: torch.Tensor, attention: str):
    """Runs `model` (a transformers model, or a PEFT/DDP wrapper's inner one) with the oracle
    attention for this keep mask and semantics; asserts that the oracle was really called."""
    assert attention in ("kept_only", "exact_query")
    base = model
    while hasattr(base, "get_base_model") or hasattr(base, "module"):
        base = base.get_base_model() if hasattr(base, "get_base_model") else base.module
    before = base.config._attn_implementation
    base.set_attn_implementation(ORACLE)
    _state.update(keep=keep, attention=attention, calls=0, source_modules=source_attentions(base))
    try:
        yield
        assert _state["calls"] > 0, "the oracle attention was never called: the model did not dispatch to it"
    finally:
        _state.update(keep=None, attention=None, source_modules=None)
        base.set_attn_implementation(before)


# ---- tiny random models (seeded) ---------------------------------------------------------------
# Hidden 32, 2 layers, 4 heads of 8, vocab 128; initializer_range 0.2 so that attention is far from
# uniform (a test that cannot tell the semantics apart would prove nothing).
FAMILIES = ("llama", "qwen2", "phi")


def tiny_config(family: str, attn: str, **overrides):
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, initializer_range=0.2, attention_dropout=0.0, use_cache=False)
    common.update(overrides)
    if family == "llama":  # GQA: 2 KV heads for 4 query heads
        from transformers import LlamaConfig
        return LlamaConfig(num_key_value_heads=2, **common, attn_implementation=attn)
    if family == "qwen2":  # QKV bias, tied LM head, GQA
        from transformers import Qwen2Config
        return Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common, attn_implementation=attn)
    if family == "phi":  # partial rotary (half the head dim), parallel attention + MLP block, LayerNorm
        from transformers import PhiConfig
        return PhiConfig(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, **common, attn_implementation=attn)
    if family == "phi3":  # fused QKV and gate/up projections, GQA
        from transformers import Phi3Config
        return Phi3Config(num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, **common,
                          attn_implementation=attn)
    if family == "mistral":  # sliding-window attention over 16 positions (shorter than the test's T)
        from transformers import MistralConfig
        return MistralConfig(num_key_value_heads=2, sliding_window=16, **common, attn_implementation=attn)
    if family == "gemma3":  # alternating sliding-window (16) and global layers, query pre-attention scaling
        from transformers import Gemma3TextConfig
        gemma = dict(common, num_hidden_layers=4)
        return Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=16, query_pre_attn_scalar=8,
                                layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=None,
                                attn_logit_softcapping=None, **gemma, attn_implementation=attn)
    if family == "gemma2":  # attention logit soft-capping (cap * tanh(s / cap)) and final-logit soft-capping
        from transformers import Gemma2Config
        return Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=16, query_pre_attn_scalar=8,
                            attn_logit_softcapping=2.0, final_logit_softcapping=30.0, **common, attn_implementation=attn)
    if family == "falcon":  # multi-query attention (one key/value head), fused QKV, parallel block
        from transformers import FalconConfig
        falcon = {k: v for k, v in common.items() if k not in ("intermediate_size", "max_position_embeddings")}
        return FalconConfig(multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
                            alibi=False, hidden_dropout=0.0, **falcon, attn_implementation=attn)
    if family == "bloom":  # ALiBi biases (baddbmm), fused QKV, its GELU a Python custom autograd Function
        from transformers import BloomConfig
        return BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, initializer_range=0.2,
                           attention_dropout=0.0, hidden_dropout=0.0, use_cache=False, attn_implementation=attn)
    # Mixtures of experts: 4 experts, top-2, transformers' eager experts (one route per expert).
    moe = {"experts_implementation": "eager", **common}
    if family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             router_aux_loss_coef=0.5, **moe, attn_implementation=attn)
    if family == "qwen2_moe":  # a shared expert beside the routed ones, with its own sigmoid gate
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                              shared_expert_intermediate_size=32, decoder_sparse_step=1, router_aux_loss_coef=0.5,
                              **moe, attn_implementation=attn)
    if family == "qwen3_moe":  # q/k norms, top-k weights renormalised
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=24, decoder_sparse_step=1, norm_topk_prob=True,
                              router_aux_loss_coef=0.5, **moe, attn_implementation=attn)
    if family == "deepseek_v3":  # latent attention (keys assembled in place), a shared expert, grouped top-k
        from transformers import DeepseekV3Config
        ds = {k: v for k, v in moe.items() if k != "intermediate_size"}
        return DeepseekV3Config(intermediate_size=64, moe_intermediate_size=24, n_routed_experts=4, n_shared_experts=1,
                                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
                                kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                num_key_value_heads=4, rope_scaling=None, **ds, attn_implementation=attn)
    if family == "gpt_oss":  # attention sinks (one more softmax logit per head), alternating sliding windows, eager only
        from transformers import GptOssConfig
        oss = {k: v for k, v in moe.items() if k != "intermediate_size"}
        return GptOssConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
                            head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                            router_aux_loss_coef=0.5, **oss, attn_implementation=attn)
    if family == "olmoe":
        from transformers import OlmoeConfig
        return OlmoeConfig(num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
                           pad_token_id=1, eos_token_id=2, **moe, attn_implementation=attn)
    raise ValueError(family)


def moe_blocks(model) -> list:
    """The model's sparse mixture-of-experts blocks (empty for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith(("SparseMoeBlock", "V3MoE")) or type(m).__name__ == "GptOssMLP"]


@contextlib.contextmanager
def moe_inputs_detached(model, keep: torch.Tensor):
    """The mixture-of-experts half of the oracle: every sparse MoE block's input rows of dropped
    tokens are detached (torch.where(keep, x, x.detach())), so the experts and the router give
    them no gradient. Asserts that at least one block was found."""
    hooks = []

    def detach_dropped(module, args):
        x = args[0]  # [B, T, D]
        return (torch.where(keep.to(x.device)[..., None], x, x.detach()),) + tuple(args[1:])

    for module in moe_blocks(model):
        hooks.append(module.register_forward_pre_hook(detach_dropped))
    assert hooks, "no mixture-of-experts block in the model"
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def model_oracle(model, keep: torch.Tensor, attention: str):
    """The whole oracle of a dense or mixture-of-experts model: oracle_keep, and moe_inputs_detached
    where the model has sparse MoE blocks."""
    experts = moe_inputs_detached(model, keep) if moe_blocks(model) else contextlib.nullcontext()
    with oracle_keep(model, keep, attention), experts:
        yield


@contextlib.contextmanager
def falcon_oracle_keep(model, keep: torch.Tensor):
    """The exact_query oracle for Falcon. Up to transformers 5.24 its attention does not dispatch
    through transformers' AttentionInterface: the key and value rows of dropped tokens are detached
    where its fused QKV projection is split into heads (FalconAttention._split_heads), so dK, dV of
    dropped rows are discarded and everything else is plain autograd. From 5.25 it dispatches
    through the interface (and has no _split_heads): oracle_keep, the oracle of every such model."""
    from transformers.models.falcon import modeling_falcon
    if not hasattr(modeling_falcon.FalconAttention, "_split_heads"):
        with oracle_keep(model, keep, "exact_query"):
            yield
        return
    split = modeling_falcon.FalconAttention._split_heads
    calls = []

    def split_detached(self, fused_qkv):
        query, key, value = split(self, fused_qkv)  # [B, T, heads, E]
        kept = keep.to(key.device)[:, :, None, None]
        calls.append(1)
        return query, torch.where(kept, key, key.detach()), torch.where(kept, value, value.detach())

    modeling_falcon.FalconAttention._split_heads = split_detached
    try:
        yield
        assert calls, "Falcon's _split_heads was never called"
    finally:
        modeling_falcon.FalconAttention._split_heads = split


@contextlib.contextmanager
def bloom_oracle_keep(model, keep: torch.Tensor, attention: str):
    """The oracle for BLOOM, whose attention does not dispatch through transformers'
    AttentionInterface: BloomAttention.forward replaced, inside the context, by the same math
    (ALiBi bias + Q K^T / sqrt(E), the additive mask, softmax in float32, P V, the output
    projection and residual) with oracle_attention's detaches for `attention`. Dropout must be 0."""
    from transformers.models.bloom import modeling_bloom
    forward = modeling_bloom.BloomAttention.forward
    calls = []

    def oracle_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                       output_attentions=False, **kwargs):
        B, T, _ = hidden_states.shape
        query, key, value = self._reshape(self.query_key_value(hidden_states))  # [B, H, T, E]
        m_kv = keep.to(key.device)[:, None, :, None]
        key = torch.where(m_kv, key, key.detach())
        value = torch.where(m_kv, value, value.detach())
        s = alibi.view(B, self.num_heads, 1, T) * self.beta + self.inv_norm_factor * (query @ key.transpose(-1, -2))
        if attention_mask is not None:
            s = s + attention_mask
        m_col = keep.to(s.device)[:, None, None, :]
        if attention == "kept_only":
            s = torch.where(m_col, s, s.detach())
        p = torch.softmax(s.float(), dim=-1).to(query.dtype)
        if attention == "kept_only":
            p = torch.where(m_col, p, p.detach())
        out = self.dense((p @ value).transpose(1, 2).reshape(B, T, -1))
        calls.append(1)
        return modeling_bloom.dropout_add(out, residual, self.hidden_dropout, self.training), p

    modeling_bloom.BloomAttention.forward = oracle_forward
    try:
        yield
        assert calls, "BLOOM's attention was never called"
    finally:
        modeling_bloom.BloomAttention.forward = forward


def tiny_model(family: str, attn: str, dtype=torch.float64, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = tiny_config(family, attn, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)
    model.train()
    assert model.config._attn_implementation == attn
    return model


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def max_rel_diff(got: dict, ref: dict) -> float:
    """max over parameters of max|got - ref| / max|ref|; infinite where either side is not finite
    (a NaN would otherwise compare as no difference at all)."""
    assert got.keys() == ref.keys(), f"different gradient sets: {sorted(set(got) ^ set(ref))}"
    worst = 0.0
    for k in ref:
        if not (bool(torch.isfinite(got[k]).all()) and bool(torch.isfinite(ref[k]).all())):
            return float("inf")
        denom = ref[k].abs().max().item()
        diff = (got[k] - ref[k]).abs().max().item()
        worst = max(worst, diff / denom if denom > 0 else diff)
    return worst
