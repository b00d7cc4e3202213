"""collider.hf: Collider on Hugging Face transformers causal language models.

Two things a transformers user needs beyond collider.filter_backward:
  plan = collider.hf.trace_plan(model)          # a plan from the model alone (dummy batches from its config)
  trainer = collider.hf.Rho1Trainer(model=model, reference_model=ref, args=args, train_dataset=ds,
                                    filter_ratio=0.4, attention="kept_only")   # RHO-1 with Collider
  trainer.train()

Positions. transformers' causal-LM loss shifts the labels inside the model: the hidden state at
position t predicts labels[t + 1], and the last position predicts nothing. Collider's keep mask is
laid out on the positions of the hidden states (DESIGN.md section 2), so keep[b, t] refers to the
loss of labels[b, t + 1]: `keep_mask_from_labels` reads it off labels, `drop_labels` writes a keep
mask back into labels (-100 on the label of every dropped position), `token_losses` gives the
per-token loss on those same positions. The last position is never kept.

Loss forms (the plan must be traced with the form the training step uses):
  "labels"     transformers' own loss: model.loss_function(logits, drop_labels(labels, keep)), the
               same code as model(input_ids, labels=...).loss (mean over the kept labels);
  "per_token"  a per-token loss written by the user: masked_mean(token_losses(logits, labels), keep);
  "fused_head" the same loss through Collider's fused LM head (collider.score_head on the model's
               final hidden states and lm_head): every token scored, only the kept ones
               backpropagated, no [B, T, V] logits (hidden_states, score_tokens).
collider.filter_backward takes right-padded rows (attention_mask, labels -100 on the padding) and
packed rows (position_ids restarting per document) under eager attention; Rho1Trainer trains on
equal-length windows (an attention_mask with zeros is refused there).
Tests: python/tests/test_hf_gradients.py, test_hf_trainer.py; example: examples/train_rho1_llama.py.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

import collider as _collider
from collider import Error, Plan, UntraceableRoutes

__all__ = [
    "IGNORE_INDEX",
    "LOSS_FORMS",
    "METHODS",
    "shift_labels",
    "keep_mask_from_labels",
    "drop_labels",
    "token_losses",
    "masked_mean",
    "step_kept_count",
    "causal_lm_loss",
    "hidden_states",
    "score_tokens",
    "router_aux_loss",
    "training_loss",
    "trace_plan",
    "Rho1Selection",
    "Rho1Trainer",
]

IGNORE_INDEX = -100  # transformers' "no label here"
LOSS_FORMS = ("labels", "per_token", "fused_head")
METHODS = ("collider", "loss_only", "regular")


def _unwrap(model: torch.nn.Module, who: str) -> torch.nn.Module:
    """The transformers model inside DDP / PEFT wrappers; refuses torch.compile'd models."""
    m = model
    for _ in range(8):
        if _is_compiled(m):
            raise Error(
                f"{who}: the model is compiled with torch.compile; Collider rewrites the per-operator autograd "
                "graph that eager PyTorch records, and a compiled graph runs the backward as one opaque "
                "CompiledFunctionBackward node. Pass the model before torch.compile (model._orig_mod)")
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            m = m.module
        elif hasattr(m, "get_base_model") and callable(m.get_base_model):  # peft.PeftModel
            inner = m.get_base_model()
            if inner is m:
                break
            m = inner
        else:
            break
    if not hasattr(m, "config") or not hasattr(m.config, "vocab_size"):
        raise Error(f"{who}: expected a transformers causal LM (a model with .config.vocab_size), got "
                    f"{type(m).__name__}")
    return m


def _is_compiled(m: Any) -> bool:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return isinstance(m, OptimizedModule)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of every hidden-state position, [B, T]: labels[:, t + 1], and -100 at the last."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def keep_mask_from_labels(labels: torch.Tensor) -> torch.Tensor:
    """bool [B, T] on the hidden-state positions: True where the position has a label to predict."""
    return shift_labels(labels) != IGNORE_INDEX


def drop_labels(labels: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """labels with -100 on the label of every position the keep mask drops, so that transformers'
    loss (which shifts internally) counts exactly the kept positions."""
    if keep_mask.shape != labels.shape:
        raise Error(f"drop_labels: keep_mask {list(keep_mask.shape)} and labels {list(labels.shape)} must both be [B, T]")
    out = labels.clone()
    out[:, 1:] = torch.where(keep_mask[:, :-1].to(labels.device), labels[:, 1:], IGNORE_INDEX)
    return out


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [B, T] on the hidden-state positions: position t against
    labels[t + 1]; 0 where there is no label. The per-token loss form. Half-precision logits are
    upcast to float32 (as transformers' loss does); float32 and float64 stay as they are."""
    B, T, V = logits.shape
    target = shift_labels(labels).to(logits.device)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(B * T, V), target.reshape(B * T), reduction="none",
                           ignore_index=IGNORE_INDEX).view(B, T)


def masked_mean(token_loss: torch.Tensor, keep_mask: torch.Tensor,
                num_kept: Optional[Any] = None) -> torch.Tensor:
    """Mean of the per-token loss over the kept positions (a multiplication, not indexing, so the
    graph keeps its [B, T] layout for the rewrite). num_kept: the denominator instead of this batch's
    kept count, the kept tokens of the whole optimizer step (every micro-batch of gradient
    accumulation, every rank: step_kept_count), so that the summed gradients equal one big batch's.
    Under DDP or FSDP2, which average gradients over ranks, multiply the loss by the world size."""
    keep = keep_mask.to(token_loss.dtype)
    total = (token_loss * keep).sum()
    if num_kept is None:
        return total / keep.sum().clamp(min=1)
    return total / torch.as_tensor(num_kept, dtype=token_loss.dtype, device=token_loss.device).clamp(min=1)


def step_kept_count(valid_masks: list, filter_ratio: float, policy: str = "per_sequence", align: int = 8,
                    group: Any = None) -> torch.Tensor:
    """The kept tokens of one optimizer step: collider.kept_total of each micro-batch's valid mask
    (keep_mask_from_labels), summed, and summed over the ranks of `group` when torch.distributed is
    initialised (one all-reduce). Known before any forward, as transformers' num_items_in_batch is."""
    total = sum(_collider.kept_total(v, filter_ratio, policy, align) for v in valid_masks)
    count = torch.tensor(total, dtype=torch.int64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        device = valid_masks[0].device if valid_masks else torch.device("cpu")
        if torch.distributed.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        count = count.to(device)
        torch.distributed.all_reduce(count, group=group)
    return count


def causal_lm_loss(model: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor,
                   num_kept: Optional[Any] = None) -> torch.Tensor:
    """transformers' own causal-LM loss on the logits (the code model(input_ids, labels=labels).loss
    runs): the mean over the labelled positions, or their sum / num_kept (its num_items_in_batch)."""
    base = _unwrap(model, "causal_lm_loss")
    kwargs = {} if num_kept is None else {"num_items_in_batch": num_kept}
    return base.loss_function(logits=logits, labels=labels, vocab_size=base.config.vocab_size, **kwargs)


def _head_of(base: torch.nn.Module, who: str) -> dict:
    """The LM head as score_head takes it: weight, bias and the logit transforms the model's config
    names (Gemma2/3 final_logit_softcapping, Cohere logit_scale, Granite logits_scaling)."""
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise Error(f"{who}: {type(base).__name__}'s output embeddings are {type(head).__name__}, not a "
                    "torch.nn.Linear the fused head can take; use loss='labels'")
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    return {"weight": head.weight, "bias": head.bias, "softcap": getattr(cfg, "final_logit_softcapping", None),
            "logit_scale": scale}


def hidden_states(model: torch.nn.Module, **forward) -> torch.Tensor:
    """The final hidden states [B, T, D] of a transformers causal LM (its decoder's
    last_hidden_state, the LM head's input), without the head: forward holds the model's keywords
    (input_ids, attention_mask, position_ids, ...)."""
    base = _unwrap(model, "hidden_states")
    forward = {k: v for k, v in forward.items() if k not in ("labels", "num_items_in_batch")}
    forward["use_cache"] = False
    return base.get_decoder()(**forward).last_hidden_state


_HEAD_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_head(base: torch.nn.Module, head: dict, forward: dict, labels: torch.Tensor) -> None:
    """Once per model: the fused head's token losses on the first row (at most 64 positions) of a
    batch equal the model's own logits' (a CausalLM whose forward does more than its lm_head and the
    transforms _head_of knows would score otherwise: refused, before any step)."""
    if base in _HEAD_CHECKED:
        return
    forward = {k: v for k, v in forward.items() if k not in ("labels", "num_items_in_batch")}
    n = min(int(labels.shape[1]), 64)
    if set(forward) <= {"input_ids", "attention_mask", "position_ids", "token_type_ids", "use_cache"}:
        small = {k: (v[:1, :n] if isinstance(v, torch.Tensor) else v) for k, v in forward.items()}
    else:  # keywords that describe the whole batch (a flash-attention varlen layout): all of it
        small, n = dict(forward), int(labels.shape[1])
    small["use_cache"] = False
    with torch.no_grad():
        rows = labels[: small["input_ids"].shape[0] if "input_ids" in small else 1, :n]
        own = token_losses(base(**small).logits, rows)
        hidden = base.get_decoder()(**small).last_hidden_state
        fused = _collider.score_head(hidden, head["weight"], shift_labels(rows).to(hidden.device),
                                     head["bias"], softcap=head["softcap"], logit_scale=head["logit_scale"]).token_loss
    tol = 1e-9 if own.dtype == torch.float64 else (1e-4 if own.dtype == torch.float32 else 2e-2)
    diff = float((fused.to(own.dtype) - own).abs().max()) / max(float(own.abs().max()), 1e-6)
    if not diff <= tol:
        raise Error(f"collider.hf: the fused head does not reproduce {type(base).__name__}'s own token losses "
                    f"(relative difference {diff:.2g}): its forward does more to the logits than the LM head "
                    "and the transforms collider knows; use loss='labels' (or fused_head=False)")
    _HEAD_CHECKED[base] = True


def score_tokens(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, entropy: bool = False,
                 forward: Optional[dict] = None) -> "_collider.ScoredHead":
    """Every position's loss (and entropy) from the final hidden states through the model's own LM
    head, fused (collider.score_head): position t against labels[t + 1], 0 where there is no label,
    as token_losses gives from logits, with no [B, T, V] logits. `.loss(keep, count)` is the filtered
    loss. forward: the keywords `hidden` came from; given, the head is checked once per model against
    the model's own logits on a slice of them (a head collider cannot reproduce is refused)."""
    base = _unwrap(model, "score_tokens")
    head = _head_of(base, "score_tokens")
    if forward is not None:
        _check_head(base, head, forward, labels)
    target = shift_labels(labels).to(hidden.device)
    return _collider.score_head(hidden, head["weight"], target, head["bias"], softcap=head["softcap"],
                                logit_scale=head["logit_scale"], entropy=entropy)


def router_aux_loss(model: torch.nn.Module, router_logits: tuple, keep_mask: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss of a transformers mixture-of-experts model (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE) over the kept tokens only: transformers' own load_balancing_loss_func on
    router_logits (the model's output with output_router_logits=True) with the keep mask as its
    attention mask. Dropped tokens contribute nothing to the gradient, the router's included (the
    filtered semantics); normalised by this batch's kept tokens, as transformers normalises by its
    own. Unscaled: training_loss(router_aux_loss=True) adds config.router_aux_loss_coef times it."""
    import sys
    base = _unwrap(model, "router_aux_loss")
    balance = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    experts = getattr(base.config, "num_local_experts", None) or getattr(base.config, "num_experts", None)
    top_k = getattr(base.config, "num_experts_per_tok", None)
    if balance is None or not experts or not top_k:
        raise Error(f"router_aux_loss: {type(base).__name__} is not a transformers mixture-of-experts model with a "
                    "load-balancing loss (load_balancing_loss_func, num_experts_per_tok)")
    if not isinstance(router_logits, tuple) or not router_logits:
        raise Error("router_aux_loss: router_logits must be the model's tuple of per-layer router logits "
                    "(run the forward with output_router_logits=True)")
    return balance(router_logits, experts, top_k, keep_mask.to(router_logits[0].device))


def training_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, keep_mask: torch.Tensor,
                  loss: str = "labels", logits: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, num_kept: Optional[Any] = None,
                  router_aux: bool = False, scored: Optional[Any] = None) -> torch.Tensor:
    """The scalar loss of a filtered step in one of LOSS_FORMS (the form trace_plan traces).
    `logits`: the model's output on input_ids if the caller already ran the forward;
    `attention_mask`: passed to that forward otherwise (padded rows); `num_kept`: normalise by the
    kept tokens of the whole optimizer step instead of this batch's (masked_mean); `router_aux`: a
    mixture-of-experts model's load-balancing loss over the kept tokens added, times
    config.router_aux_loss_coef (router_aux_loss; the forward runs here, so no `logits`)."""
    if loss not in LOSS_FORMS:
        raise Error(f"training_loss: loss must be one of {', '.join(LOSS_FORMS)}; got {loss!r}")
    if loss == "fused_head":
        if router_aux or logits is not None:
            raise Error("training_loss: loss='fused_head' computes no logits; pass `scored` (score_tokens) "
                        "instead of logits, and no router_aux")
        if scored is None:
            forward = {"input_ids": input_ids, "attention_mask": attention_mask}
            scored = score_tokens(model, hidden_states(model, **forward), labels, forward=forward)
        counted = keep_mask.to(labels.device) & keep_mask_from_labels(labels)
        count = float(counted.sum()) if num_kept is None else float(num_kept)
        return scored.loss(keep_mask.to(labels.device).bool(), max(count, 1.0))
    aux = None
    if router_aux:
        if logits is not None:
            raise Error("training_loss: router_aux=True runs the forward itself (it needs the router logits); "
                        "pass no logits")
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_router_logits=True)
        logits = out.logits
        coef = float(getattr(_unwrap(model, "training_loss").config, "router_aux_loss_coef", 0.0))
        aux = coef * router_aux_loss(model, out.router_logits, keep_mask)
    elif logits is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if loss == "labels":
        main = causal_lm_loss(model, logits, drop_labels(labels, keep_mask), num_kept)
    else:
        main = masked_mean(token_losses(logits, labels), keep_mask, num_kept)
    return main if aux is None else main + aux.to(main.dtype)


def trace_plan(model: torch.nn.Module, loss: str = "labels", router_aux: bool = False,
               seq_len: Optional[int] = None) -> Plan:
    """collider.trace_plan for a transformers causal LM, from the model alone: random token ids in
    [0, config.vocab_size), use_cache=False, the loss form `loss` (see LOSS_FORMS) with a random
    half of the positions kept. Traced twice and merged (Plan.merge): without an attention mask and
    with a padded one, since transformers builds another graph when it passes a mask (SDPA with
    grouped-query attention repeats the key/value heads then), so the plan serves plain, padded
    and packed batches alike. Trace in the mode you train in (model.train()): dropout layers
    change the graph. Works through DistributedDataParallel and PEFT wrappers; refuses a
    torch.compile'd model. router_aux: the loss adds a mixture-of-experts model's load-balancing
    loss over the kept tokens (training_loss(router_aux=True)); trace with the steps' setting.
    Mixture-of-experts models are filtered with transformers' default grouped experts and with its
    eager ones; grouped experts with one expert per token need experts_implementation="eager".
    seq_len: trace at the steps' sequence length (and at T - 1 or T + 1, whichever gives the same graph)
    instead of the default lengths: for a model whose graph follows the length (the reference scans of
    Qwen3.5 and Qwen3-Next loop over chunks of 64 positions in Python), whose default plan then does not
    match the steps' graph. One plan per length; Plan.merge keeps several in one."""
    base = _unwrap(model, "collider.hf.trace_plan")
    if loss not in LOSS_FORMS:
        raise Error(f"collider.hf.trace_plan: loss must be one of {', '.join(LOSS_FORMS)}; got {loss!r}")
    vocab = int(base.config.vocab_size)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        raise Error("collider.hf.trace_plan: the model has no parameters") from None
    gen = torch.Generator().manual_seed(0)

    def loss_on_random_batch(batch: int, seq_len: int, padded: bool = False) -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
        keep = torch.rand(batch, seq_len, generator=gen).argsort(dim=1) < seq_len // 2
        attention_mask, labels = None, ids
        if padded:  # the last position of the first row is padding
            attention_mask = torch.ones_like(ids)
            attention_mask[0, -1] = 0
            labels = ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
            keep = keep & keep_mask_from_labels(labels).cpu()
        return training_loss(model, ids, labels, keep.to(device), loss=loss, attention_mask=attention_mask,
                             router_aux=router_aux)

    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 3):
        raise Error(f"collider.hf.trace_plan: seq_len must be an int >= 3 (the steps' sequence length), got {seq_len!r}")
    try:
        if seq_len is None:
            shapes = _trace_shapes(base.config)
            plan = _collider.trace_plan(loss_on_random_batch, shapes)
            plan.merge(_collider.trace_plan(lambda b, t: loss_on_random_batch(b, t, padded=True), shapes))
        else:
            plan = _trace_at_length(loss_on_random_batch, seq_len)
    except UntraceableRoutes:
        # Other random tokens do not help a router that sends every token to the same few experts,
        # as new models' routers often do; grouped experts run one graph whatever the routing.
        raise UntraceableRoutes(
            "collider.hf.trace_plan: in every try an expert got none or all of the random tokens (a new model's "
            "router often sends them all to a few experts); load the model with "
            "experts_implementation=\"grouped_mm\" (transformers' default) or trace a trained router") from None
    return plan


def _trace_at_length(loss_on_random_batch, seq_len: int) -> Plan:
    """The plan traced at (3, seq_len) and (5, a neighbour length): T - 1, or T + 1 where T - 1 gives
    another graph (a loop over chunks whose count changes between them), unpadded and padded."""
    b_a, _, b_b, _ = _collider._TRACE_SHAPES
    first = None
    for other in (seq_len - 1, seq_len + 1):
        shapes = (b_a, seq_len, b_b, other)
        try:
            plan = _collider.trace_plan(loss_on_random_batch, shapes)
        except Error as e:
            if "must not depend on the batch or sequence size" not in str(e):
                raise
            first = first or e
            continue
        plan.merge(_collider.trace_plan(lambda b, t: loss_on_random_batch(b, t, padded=True), shapes))
        return plan
    raise Error(f"collider.hf.trace_plan(seq_len={seq_len}): the graph at T = {seq_len} is neither that at "
                f"T - 1 nor at T + 1 (a loop over every position, as a recurrent layer's reference forward "
                f"runs, cannot be traced): {first}") from first


def _trace_shapes(config) -> tuple:
    """collider.trace_plan's shapes for this model: the default ones, or for a mixture-of-experts
    model with many experts longer sequences (primes), so that every expert receives about 24
    tokens or more even in the one-row traces (an expert left without tokens drops out of the graph)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    default = _collider._TRACE_SHAPES
    need = -(-24 * int(experts) // int(top_k)) if experts else 0
    if need <= default[1]:
        return default

    def prime_from(n: int) -> int:
        while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
            n += 1
        return n

    seq_a = prime_from(need)
    return (default[0], seq_a, default[2], prime_from(seq_a + 5))


try:
    from transformers import Trainer as _Trainer
except ImportError:  # pragma: no cover - collider without transformers
    _Trainer = None


class Rho1Selection:
    """What Rho1Trainer and collider.trl.Rho1SFTTrainer share, mixed into a transformers.Trainer
    subclass (it reads self.args and self.accelerator): their arguments, RHO-1's selection against
    the reference model, the optimizer step's kept count as Trainer's num_items_in_batch, and the
    whole training step's loss (_rho1_loss, which both compute_loss methods call with the forward
    keywords and labels they make from their batches; the loss form is fixed at construction).

    Normalisation: the loss is the sum of the kept tokens' losses over the kept tokens of the whole
    optimizer step, every micro-batch of gradient accumulation and, with
    average_tokens_across_devices (transformers' default), every rank: the kept count is known from
    the labels before any forward (collider.kept_total), so accumulation and data parallelism give
    the gradient of one big batch, ragged batch_topk rows included."""

    @staticmethod
    def _check_rho1_arguments(who: str, reference_model, filter_ratio, method, attention, policy) -> None:
        if method not in METHODS:
            raise Error(f"{who}: method must be one of {', '.join(METHODS)}; got {method!r}")
        if attention not in ("kept_only", "exact_query"):
            raise Error(f"{who}: attention must be kept_only or exact_query; got {attention!r}")
        if method != "regular" and reference_model is None:
            raise Error(f"{who}: RHO-1 selection needs a reference_model (trained on the curated data); "
                        "use method='regular' to train on every token")
        if policy not in ("per_sequence", "batch_topk"):
            raise Error(f"{who}: policy must be per_sequence or batch_topk; got {policy!r}")
        if not 0.0 <= float(filter_ratio) < 1.0:
            raise Error(f"{who}: filter_ratio {filter_ratio} is outside [0, 1): it is the fraction dropped")

    def _init_rho1(self, reference_model, filter_ratio, method, attention, policy, align, loss_form) -> None:
        """loss_form: the trainer's loss form (LOSS_FORMS), the one trace_plan traces and training_loss computes."""
        self.loss_form = loss_form
        self.fused_head = loss_form == "fused_head"
        self.reference_model = reference_model
        if reference_model is not None:
            reference_model.eval()
            reference_model.requires_grad_(False)
        self.filter_ratio, self.method, self.attention = float(filter_ratio), method, attention
        self.policy, self.align = policy, int(align)
        # The loss is normalised by the step's kept count (num_items_in_batch, counted by
        # _get_num_items_in_batch below): Trainer must not divide it by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = True
        self.collider_plan: Optional[Plan] = None
        self.last_keep_mask: Optional[torch.Tensor] = None
        self.last_filter_stats = None

    def _get_num_items_in_batch(self, batch_samples, device):
        """The kept tokens of the optimizer step: what the selection keeps of each micro-batch (known
        from its labels), summed over micro-batches and, with average_tokens_across_devices, ranks."""
        valid = [keep_mask_from_labels(b.get("labels", b["input_ids"])) for b in batch_samples]
        if self.method == "regular":
            total = sum(int(v.sum()) for v in valid)
        else:
            total = sum(_collider.kept_total(v, self.filter_ratio, self.policy, self.align) for v in valid)
        count = torch.tensor(total, dtype=torch.int64, device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count

    def _rho1_keep(self, mine: torch.Tensor, labels: torch.Tensor, training: bool, forward: dict) -> torch.Tensor:
        """The keep mask: every labelled position for method "regular" or outside training, else the
        top of the excess loss (mine: the model's per-token loss [B, T], token_losses or the fused
        head's) against the reference model (run on the same `forward` arguments; through the fused
        head too when the trainer's is)."""
        valid = keep_mask_from_labels(labels).to(mine.device)
        if self.method == "regular" or not training:
            return valid
        with torch.no_grad():
            reference = self.reference_model
            if next(reference.parameters()).device != mine.device:
                reference.to(mine.device)
            if self.fused_head:
                theirs = score_tokens(reference, hidden_states(reference, **forward), labels, forward=forward).token_loss
            else:
                theirs = token_losses(reference(**forward).logits, labels)
            scores = mine.detach() - theirs.to(mine.device)  # RHO-1 excess loss
        return _collider.select_tokens(scores, self.filter_ratio, policy=self.policy, align=self.align, valid=valid)

    def _rho1_loss(self, model, forward: dict, labels: torch.Tensor, return_outputs: bool, num_items_in_batch):
        """One step's loss, what compute_loss returns: the plan traced once (before the first training
        step, in self.loss_form), the model's per-token loss [B, T] (through the fused head, score_tokens,
        with no [B, T, V] logits; or from the model's logits), the keep mask (_rho1_keep), the loss in
        self.loss_form normalised by the step's kept count (training_loss), then _rho1_finish.
        forward: the model's keywords made from the batch (use_cache=False among them); labels [B, T]."""
        training = model.training and torch.is_grad_enabled()
        if training and self.method == "collider" and self.collider_plan is None:
            self.collider_plan = trace_plan(model, loss=self.loss_form)  # once, before the first step
        step_count = num_items_in_batch if training else None
        input_ids = forward.get("input_ids")
        if self.fused_head:
            scored = score_tokens(model, hidden_states(model, **forward), labels, forward=forward)
            keep = self._rho1_keep(scored.token_loss, labels, training, forward)
            loss = training_loss(model, input_ids, labels, keep, loss="fused_head", num_kept=step_count,
                                 scored=scored)
            outputs = {"loss": loss}
        else:
            outputs = model(**forward)
            keep = self._rho1_keep(token_losses(outputs.logits.detach(), labels), labels, training, forward)
            loss = training_loss(model, input_ids, labels, keep, loss=self.loss_form, logits=outputs.logits,
                                 num_kept=step_count)
        loss = self._rho1_finish(loss, keep, training, step_count)
        return (loss, outputs) if return_outputs else loss

    def _rho1_finish(self, loss: torch.Tensor, keep: torch.Tensor, training: bool, step_count) -> torch.Tensor:
        """The loss as the backward takes it: scaled by the world size when the count spans ranks
        (DDP averages over them), and filtered (the one added line) for method "collider"."""
        if step_count is not None and self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes
        if training:
            self.last_keep_mask = keep
            if self.method == "collider" and bool(keep.any()):
                # Trainer.training_step's accelerator.backward(loss) follows. (A micro-batch that
                # keeps nothing has a zero loss and gradient: nothing to filter.)
                self.last_filter_stats = _collider.filter_backward(loss, keep, self.collider_plan,
                                                                   attention=self.attention)
        return loss


if _Trainer is not None:

    class Rho1Trainer(Rho1Selection, _Trainer):
        """transformers.Trainer with RHO-1 token selection and Collider's filtered backward.

        Every training step: the model's per-token loss and the reference model's (no grad) give
        the excess loss; collider.select_tokens keeps the top (1 - filter_ratio) of every sequence
        (policy="per_sequence", the same count per row) or of the whole batch ("batch_topk", RHO-1's
        own, ragged rows); the labels of the dropped positions are set to -100
        (loss="labels": transformers' own loss; "per_token": a masked mean of token_losses); then
        collider.filter_backward(loss, keep, plan, attention) rewrites the graph, and Trainer's
        training_step runs accelerator.backward on it. The plan is traced on the first step
        (collider.hf.trace_plan on the model as the Trainer wraps it). The loss is normalised over
        the optimizer step's kept tokens (Rho1Selection).

        fused_head=True (off by default): the model's per-token losses come from Collider's fused LM
        head on its final hidden states (score_tokens), every token scored, only the kept ones
        backpropagated, with no [B, T, V] logits; the loss is the kept tokens' mean (loss form
        "fused_head"). The head is checked once against the model's own logits.
        method: "collider" (the above), "loss_only" (same selection, dense backward: RHO-1 as
        existing systems run it) or "regular" (every labelled position, no reference model needed).
        Inputs: input_ids (and optional labels, default input_ids); packed sequences, so an
        attention_mask, if present, must be all ones. The last step's keep mask and FilterStats are
        in `last_keep_mask` and `last_filter_stats`.
        """

        def __init__(self, *args, reference_model: Optional[torch.nn.Module] = None, filter_ratio: float = 0.4,
                     method: str = "collider", attention: str = "kept_only", loss: str = "labels", align: int = 8,
                     policy: str = "per_sequence", fused_head: bool = False, **kwargs):
            self._check_rho1_arguments("Rho1Trainer", reference_model, filter_ratio, method, attention, policy)
            if loss not in LOSS_FORMS:
                raise Error(f"Rho1Trainer: loss must be one of {', '.join(LOSS_FORMS)}; got {loss!r}")
            if fused_head and loss not in ("labels", "fused_head"):
                raise Error(f"Rho1Trainer: fused_head=True is its own loss form (the kept tokens' mean loss); "
                            f"drop loss={loss!r}")
            super().__init__(*args, **kwargs)
            model = kwargs.get("model", args[0] if args else None)
            if model is not None:
                _unwrap(model, "Rho1Trainer")
            fused_head = fused_head or loss == "fused_head"
            self._init_rho1(reference_model, filter_ratio, method, attention, policy, align,
                            "fused_head" if fused_head else loss)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.get("labels")
            if labels is None:
                labels = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            if mask is not None and not bool(mask.bool().all()):
                raise Error("Rho1Trainer: the batch has padding (attention_mask with zeros); train on packed "
                            "sequences of equal length (windows of the token stream, as the example does)")
            forward = {"input_ids": inputs["input_ids"], "use_cache": False}
            return self._rho1_loss(model, forward, labels, return_outputs, num_items_in_batch)

else:  # pragma: no cover

    class Rho1Trainer:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise Error("collider.hf.Rho1Trainer needs transformers (pip install transformers)")
