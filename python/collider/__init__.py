"""Collider from Python: token-filtered backward for LLM training (arXiv 2502.00340), DESIGN.md 4b.

    plan = collider.trace_plan(loss_on_random_batch)     # once: callable (batch, seq_len) -> scalar loss
    collider.filter_backward(loss, keep_mask, plan, attention="kept_only")   # the one added line
    loss.backward()                                       # runs on the kept rows only

A thin typed wrapper over the C++ library (collider._C, built from collider_core): arguments are
checked here with plain messages, and every refusal, here or in C++, is a `collider.Error`.
transformers helpers (a plan from the model alone, RHO-1 with Trainer): `collider.hf`.
Tests: python/tests/ (run by ./scripts/test.sh).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.utils.checkpoint

_REINSTALL = ("rebuild it against the imported torch: `pip install --no-build-isolation ./python` in the Collider "
              "checkout, with this environment's python (or ./scripts/bootstrap.sh)")


def torch_mismatch(built_version: str, built_cxx11_abi: bool, version: str, cxx11_abi: bool) -> Optional[str]:
    """Why a collider._C compiled against torch `built_version` (C++ ABI `built_cxx11_abi`) cannot run
    under torch `version` (`cxx11_abi`), or None when it can: the release (the part before any local
    tag such as +cu130) and the ABI must be equal, since autograd's C++ types change between releases."""
    release = version.split("+")[0]
    if release != built_version:
        return (f"collider was built against torch {built_version}, but torch {release} is imported "
                f"({version}); {_REINSTALL}")
    if built_cxx11_abi != cxx11_abi:
        return (f"collider was built against torch {built_version} with _GLIBCXX_USE_CXX11_ABI="
                f"{int(built_cxx11_abi)}, but the imported torch {version} uses {int(cxx11_abi)}; {_REINSTALL}")
    return None


try:  # before _C is loaded: a module built for another torch fails there with an undefined symbol, or worse
    from ._torch_build import CXX11_ABI as _BUILT_CXX11_ABI, TORCH_VERSION as _BUILT_TORCH
except ImportError as e:
    raise ImportError(f"collider: its build record (collider/_torch_build.py) is missing; {_REINSTALL}") from e
_mismatch = torch_mismatch(_BUILT_TORCH, _BUILT_CXX11_ABI, torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI))
if _mismatch:
    raise ImportError(_mismatch)

try:
    from . import _C
except ImportError as e:  # the extension is tied to the exact torch it was compiled against
    raise ImportError(
        f"collider: cannot load its C++ extension ({e}). It must be built against the torch that is "
        f"imported (torch {torch.__version__} here): rebuild with ./scripts/bootstrap.sh in the Collider "
        "checkout, or `pip install --no-build-isolation ./python` in this environment"
    ) from e

__all__ = [
    "Error",
    "UntraceableRoutes",
    "GradientMismatch",
    "DEFAULT_CHECK_EVERY",
    "Plan",
    "FilterStats",
    "trace_plan",
    "filter_backward",
    "mask_backward",
    "select_tokens",
    "kept_count",
    "kept_total",
    "ScoredHead",
    "HeadResult",
    "score_head",
    "fused_head_loss",
    "register_passthrough_node",
    "row_rules",
]
__version__ = "0.1.0"

#: Every refusal of the library (a node it cannot rewrite, a graph that does not match the plan, a
#: bad argument). A subclass of RuntimeError.
Error = _C.Error
Error.__module__ = "collider"
#: trace_plan's refusal of a mixture-of-experts model whose routes no try on new random tokens
#: could trace (some expert received none of them, or exactly a batch's worth). A collider.Error.
UntraceableRoutes = _C.UntraceableRoutes
UntraceableRoutes.__module__ = "collider"
GradientMismatch = _C.GradientMismatch
GradientMismatch.__module__ = "collider"
#: A traced plan: per autograd node, which dimensions are token dimensions. `to_string()`,
#: `Plan.from_string(text)`, `summary()`, `num_nodes`, `num_token_nodes`; picklable.
Plan = _C.Plan
Plan.__module__ = "collider"
#: What one filter_backward / mask_backward call did: the C++ FilterStats fields as attributes.
FilterStats = _C.FilterStats
FilterStats.__module__ = "collider"

# The field names in declaration order, from the one C++ list (collider/filter_stats_fields.h).
_STATS_FIELDS = tuple(_C.filter_stats_fields)


def _stats_to_dict(self: FilterStats) -> dict:
    return {k: getattr(self, k) for k in _STATS_FIELDS}


def _stats_repr(self: FilterStats) -> str:
    return "FilterStats(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _STATS_FIELDS) + ")"


FilterStats.to_dict = _stats_to_dict
FilterStats.__repr__ = _stats_repr

_ATTENTION = ("kept_only", "exact_query")
_POLICIES = ("per_sequence", "batch_topk")
# The two trace shapes of the C++ TraceOptions: sizes no model uses (primes), B >= 2.
_TRACE_SHAPES = (3, 53, 5, 61)


def _check_tensor(value, name: str, who: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise Error(f"{who}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_keep_mask(loss, keep_mask, plan, attention, who: str) -> None:
    _check_tensor(loss, "loss", who)
    _check_tensor(keep_mask, "keep_mask", who)
    if not isinstance(plan, Plan):
        raise Error(f"{who}: plan must be a collider.Plan (from collider.trace_plan), got {type(plan).__name__}")
    if attention not in _ATTENTION:
        raise Error(f"{who}: attention must be one of {', '.join(_ATTENTION)}; got {attention!r}")
    if loss.numel() != 1:
        raise Error(f"{who}: loss must be a scalar, got shape {list(loss.shape)}")
    if loss.grad_fn is None:
        raise Error(f"{who}: the loss has no grad_fn; build it from the model's outputs with grad enabled "
                    "(not under torch.no_grad()), and call this before loss.backward()")
    if keep_mask.dtype != torch.bool or keep_mask.dim() != 2:
        raise Error(f"{who}: keep_mask must be a bool tensor [B, T] (True = the position's loss counts), got "
                    f"{keep_mask.dtype} of shape {list(keep_mask.shape)}; see collider.select_tokens")


def trace_plan(loss_on_random_batch: Callable[[int, int], torch.Tensor],
               shapes: Tuple[int, int, int, int] = _TRACE_SHAPES) -> Plan:
    """Traces the loss graph twice on dummy batches and returns the Plan that filter_backward replays.

    `loss_on_random_batch(batch, seq_len)` must build the scalar training loss of the model on a
    random batch of that shape, the same way as the training step does (same loss form, same
    forward arguments), with grad enabled. It is called with (3, 53), (5, 61), (1, 53) and (1, 61),
    or `shapes` = (B_a, T_a, B_b, T_b) (B >= 2, sizes no model uses): a mixture-of-experts model
    needs enough tokens for every expert to receive some in every trace (a trace in which one does
    not is repeated on new random tokens, up to 8 times).
    An exception raised inside it comes back as a collider.Error whose __cause__ is the original.
    For transformers models, collider.hf.trace_plan(model) builds the callable from the config.
    """
    if not callable(loss_on_random_batch):
        raise Error(f"trace_plan: loss_on_random_batch must be callable (batch, seq_len) -> loss, got "
                    f"{type(loss_on_random_batch).__name__}")
    failure: list = []
    traced: list = []

    def call(batch: int, seq_len: int) -> torch.Tensor:
        try:
            loss = loss_on_random_batch(batch, seq_len)
        except Exception as e:
            failure.append((batch, seq_len, e))
            raise
        if not isinstance(loss, torch.Tensor):
            err = Error(f"trace_plan: loss_on_random_batch({batch}, {seq_len}) returned "
                        f"{type(loss).__name__}, not a scalar torch.Tensor")
            failure.append((batch, seq_len, err))
            raise err
        traced.append(loss)
        return loss

    try:
        with torch.enable_grad(), _one_recomputation():
            plan = _C.trace_plan(call, *shapes)
        _finish_sharded_backwards(traced)
        return plan
    except Exception as e:
        if failure:
            batch, seq_len, cause = failure[0]
            if isinstance(cause, Error):
                raise cause from None
            raise Error(f"trace_plan: loss_on_random_batch({batch}, {seq_len}) raised "
                        f"{type(cause).__name__}: {cause}") from cause
        if isinstance(e, Error):
            raise
        raise Error(f"trace_plan: {type(e).__name__}: {e}") from e


def _one_recomputation():
    """While tracing, reading the sizes of tensors saved under non-reentrant activation checkpointing
    recomputes their block: outside a backward, torch recomputes it once per tensor read unless the
    reads share a GraphExecGroup, under which each block is recomputed once."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    if group is None or torch._C._get_graph_exec_group() is not None:
        return contextlib.nullcontext()
    return group()


_FSDP2_NODE = "RegisterPostBackwardFunctionBackward"  # torch.distributed.fsdp.fully_shard's node


def _finish_sharded_backwards(losses: list) -> None:
    """A model sharded with FSDP2 (fully_shard) expects a backward after each forward: forwards left
    without one (the traces) leave its state half-done, and the next training step's gradient is
    wrong. So each traced loss of such a model gets a backward of zero (every rank traces, so every
    rank joins its collectives): the sharded gradients gain zeros, the state is the one after a step."""
    for loss in losses:
        seen, stack, sharded = set(), [loss.grad_fn], False
        while stack and not sharded:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            sharded = node.name() == _FSDP2_NODE
            stack.extend(edge[0] for edge in node.next_functions)
        if sharded:
            (loss * 0).backward()


def _refuse_compiled_autograd(who: str) -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # never imported: nothing compiles the backward
        return
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if getattr(dynamo.config, "compiled_autograd", False) or getattr(ca, "compiled_autograd_enabled", False):
        raise Error(f"{who}: compiled autograd is on (torch._dynamo.config.compiled_autograd); it compiles the backward "
                    "graph ahead of running it and cannot run Collider's rewritten nodes. Turn it off for the "
                    "filtered steps (the forward may stay compiled only if the model is traced and filtered "
                    "uncompiled)")


DEFAULT_CHECK_EVERY = _C.DEFAULT_CHECK_EVERY


def filter_backward(loss: torch.Tensor, keep_mask: torch.Tensor, plan: Plan,
                    attention: str = "kept_only", validate: bool = False,
                    check_every: int = DEFAULT_CHECK_EVERY) -> FilterStats:
    """The one added line: rewrites the autograd graph of `loss` in place so that the next
    loss.backward() runs on the kept positions only.

    keep_mask: bool [B, T] on the positions of the model's hidden states (True = kept); rows may
    keep different counts (collider.select_tokens(policy="batch_topk")), every position or none.
    The loss must already be the masked loss (dropped positions contribute nothing). The stats'
    `kept` is the largest kept count per row, `kept_total` the batch's. attention: "kept_only" (paper v1) or
    "exact_query" (v2). All or nothing: on a collider.Error the graph is unchanged, so a plain
    loss.backward() still gives the loss_only gradient.

    Every call checks, cheaply, that the loss gives dropped positions no gradient (a cross-entropy's
    targets there must be ignore_index, a per-position loss must be masked there).

    The check: validate=True runs this step's backward through the rewrite and through mask_backward
    inside the call (two extra backwards, on the same graph) and raises collider.GradientMismatch (a
    collider.Error naming the first node whose gradient differs), graph unchanged, unless every
    parameter's gradient agrees. By default the first step of each kind the plan serves (traced
    variant, semantics, equal or ragged kept counts) is checked so, and then every check_every-th step
    filtered with the plan (DEFAULT_CHECK_EVERY = 1000); check_every=0 leaves it to validate
    (benchmarks). Skipped where the graph holds a declared passthrough node (FSDP2's: its work must
    run once). stats.checked says whether this step was checked. Works under activation checkpointing (use_reentrant=False)
    and saved-tensor hooks (offloading): such tensors are cut when the backward unpacks them. The loss
    may be scaled by a constant after filter_backward or before it (loss / accumulation_steps).
    """
    _check_keep_mask(loss, keep_mask, plan, attention, "filter_backward")
    if not isinstance(validate, bool):
        raise Error(f"filter_backward: validate must be True or False, got {validate!r}")
    if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 0:
        raise Error(f"filter_backward: check_every must be an int >= 0 (0: no check unless validate), "
                    f"got {check_every!r}")
    _refuse_compiled_autograd("filter_backward")
    return _C.filter_backward(loss, keep_mask, plan, attention, validate, check_every)


def mask_backward(loss: torch.Tensor, keep_mask: torch.Tensor, plan: Plan,
                  attention: str = "kept_only") -> FilterStats:
    """The oracle of filter_backward: the same gradients, computed on full-size tensors with the
    dropped rows (and attention columns) zeroed. No speed-up; for tests and references."""
    _check_keep_mask(loss, keep_mask, plan, attention, "mask_backward")
    _refuse_compiled_autograd("mask_backward")
    return _C.mask_backward(loss, keep_mask, plan, attention)


def select_tokens(scores: torch.Tensor, filter_ratio: float, policy: str = "per_sequence", align: int = 8,
                  valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The keep mask (bool [B, T]) from per-token scores (higher = more worth keeping; RHO-1: the
    excess loss). filter_ratio in [0, 1) is the fraction dropped. policy "per_sequence" keeps the
    same count in every row (drop count rounded up to a multiple of `align`), "batch_topk" ranks
    the whole batch (RHO-1; ragged rows, which filter_backward pads to the largest). valid: optional bool
    [B, T], False = no label there (always dropped, not counted toward the ratio)."""
    _check_tensor(scores, "scores", "select_tokens")
    if isinstance(filter_ratio, bool) or not isinstance(filter_ratio, (int, float)):
        raise Error(f"select_tokens: filter_ratio must be a number in [0, 1), got {type(filter_ratio).__name__}")
    if policy not in _POLICIES:
        raise Error(f"select_tokens: policy must be one of {', '.join(_POLICIES)}; got {policy!r}")
    if isinstance(align, bool) or not isinstance(align, int):
        raise Error(f"select_tokens: align must be an int >= 1, got {align!r}")
    if valid is not None:
        _check_tensor(valid, "valid", "select_tokens")
    if scores.dim() != 2:
        raise Error(f"select_tokens: scores must be [B, T], got shape {list(scores.shape)}")
    return _C.select_tokens(scores, float(filter_ratio), policy, align, valid)


#: What score_head returns: `token_loss` (every row's cross-entropy, 0 at ignore_index, no
#: gradient), `entropy` (every row's, or None) and `loss(keep=None, divisor=1.0)`, the filtered loss.
ScoredHead = _C.ScoredHead
ScoredHead.__module__ = "collider"


class HeadResult(NamedTuple):
    """What fused_head_loss returns: `loss` (scalar, the only output with a gradient), `token_loss`
    (every row's cross-entropy, 0 at ignore_index) and `entropy` (every row's, or None)."""
    loss: torch.Tensor
    token_loss: torch.Tensor
    entropy: Optional[torch.Tensor]


def score_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: Optional[torch.Tensor] = None,
               *, ignore_index: int = -100, softcap: Optional[float] = None, logit_scale: float = 1.0,
               entropy: bool = False, chunk_rows: int = 1024, chunk_vocab: int = 8192) -> ScoredHead:
    """The fused LM head's forward over every row (collider/head.h), before the keep mask is known:
    RHO-1 picks the kept tokens from these very scores. hidden [.., D], weight [V, D] (the embedding
    matrix when tied), targets int64 of hidden's leading shape, bias [V] or None. Returns a
    ScoredHead: `token_loss` and `entropy` for every row, and `loss(keep, divisor)`, the sum of the
    kept rows' token losses divided by `divisor` (your count; the head never renormalises), whose
    backward runs on the kept rows only. No [N, V] logits are held. softcap: final logit
    soft-capping (Gemma2's final_logit_softcapping); logit_scale multiplies the logits before it."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        _check_tensor(t, name, "score_head")
    if bias is not None:
        _check_tensor(bias, "bias", "score_head")
    return _C.score_head(hidden, weight, targets, bias, int(ignore_index), float(softcap or 0.0), float(logit_scale),
                         bool(entropy), int(chunk_rows), int(chunk_vocab))


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    keep: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
                    divisor: float = 1.0, entropy: bool = False, ignore_index: int = -100,
                    softcap: Optional[float] = None, logit_scale: float = 1.0, chunk_rows: int = 1024,
                    chunk_vocab: int = 8192, recompute: bool = False) -> HeadResult:
    """The LM head and its cross-entropy in one op that scores every token but backpropagates only
    the kept ones (keep: bool of the targets' shape, None: every row), never holding the [N, V]
    logits; the loss is the kept rows' summed token loss / divisor. The keep mask being known here,
    the kept rows' gradient is made in the forward, with no recompute (recompute=True: as
    ScoredHead.loss, recomputed in the backward). Under filter_backward, pass it the same keep
    mask, laid out [B, T] on the hidden states' rows: the hidden states' gradient then leaves the
    head already cut to the kept rows. The other keywords: score_head's."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        _check_tensor(t, name, "fused_head_loss")
    for name, t in (("keep", keep), ("bias", bias)):
        if t is not None:
            _check_tensor(t, name, "fused_head_loss")
    loss, token_loss, ent = _C.fused_head_loss(
        hidden, weight, targets, keep, bias, int(ignore_index), float(softcap or 0.0), float(logit_scale),
        float(divisor), bool(entropy), int(chunk_rows), int(chunk_vocab), bool(recompute))
    return HeadResult(loss, token_loss, ent if entropy else None)


def fused_head_recomputes(rows: int, vocab: int, *, chunk_rows: int = 1024, chunk_vocab: int = 8192,
                          recompute: bool = False) -> bool:
    """Whether fused_head_loss on `rows` rows of a `vocab`-word head, with a gradient to make,
    recomputes the kept rows' logits in the backward (6 K D V backward FLOPs) instead of making their
    gradient in the forward (4 K D V): with recompute=True, or where a block holds fewer than 128
    whole-vocabulary rows (chunk_rows * chunk_vocab // vocab) and not every row."""
    return _C.fused_head_recomputes(int(rows), int(vocab), int(chunk_rows), int(chunk_vocab), bool(recompute))


def kept_count(seq_len: int, filter_ratio: float, align: int = 8) -> int:
    """Kept count per row that per_sequence selection gives for a row of `seq_len` valid positions."""
    return _C.kept_count(int(seq_len), float(filter_ratio), int(align))


def kept_total(valid: torch.Tensor, filter_ratio: float, policy: str = "per_sequence", align: int = 8) -> int:
    """How many positions select_tokens(scores, filter_ratio, policy, align, valid=valid) keeps, known
    from the valid mask alone (before any score exists): per_sequence keeps kept_count(n, ratio, align)
    in each row of n valid positions, batch_topk kept_count(n, ratio, 1) of the batch's n. The
    denominator of a loss normalised over a whole optimizer step (collider.hf.masked_mean)."""
    _check_tensor(valid, "valid", "kept_total")
    if policy not in _POLICIES:
        raise Error(f"kept_total: policy must be one of {', '.join(_POLICIES)}; got {policy!r}")
    if valid.dim() != 2:
        raise Error(f"kept_total: valid must be a bool [B, T], got shape {list(valid.shape)}")
    counts = valid.bool().sum(1).tolist()
    if policy == "batch_topk":
        n = sum(counts)
        return kept_count(n, filter_ratio, 1) if n else 0
    return sum(kept_count(n, filter_ratio, align) if n else 0 for n in counts)


def row_rules() -> list:
    """The rule by which collider cuts each autograd node type of this torch along a token
    dimension, as (node type, rule, reason) in Functions.h order: "pointwise", "layout",
    "along dim", "reduction", "norm", "matmul", "repeat", "lookup", "attention", or "refused" (a
    node of that type with a token dimension makes trace_plan refuse the model). docs/ROW_RULES.md
    lists them."""
    return _C.row_rules()


def register_passthrough_node(name: str) -> None:
    """Declares a custom autograd node (by its grad_fn name, e.g. "MyOpBackward") safe to pass
    through without running it: it saves nothing token-shaped and maps gradients row for row. A
    Python torch.autograd.Function needs no declaration: trace_plan runs its backward on cut rows
    and takes it where it maps rows one to one (saved token-shaped tensors included). Declare one
    whose backward must not run twice (it queues work for the end of the backward, as DDP's and
    FSDP2's do), or a C++ custom Function. A declared node that saves a token-shaped tensor is
    still refused, and nodes known not to be passthrough (reentrant checkpointing's
    CheckpointFunctionBackward, torch.compile graphs) are refused here."""
    if not isinstance(name, str) or not name:
        raise Error(f"register_passthrough_node: name must be a non-empty str, got {name!r}")
    _C.register_passthrough_node(name)


# Python custom Functions of torch.distributed that trace_plan must not run on cut rows (its row
# check of custom Functions): their backward queues work for the end of the backward.
# DistributedDataParallel routes outputs through _DDPSink when it looks for unused parameters or
# runs a static graph; its backward returns the gradients unchanged and it saves nothing.
register_passthrough_node("_DDPSinkBackward")
# FSDP2 (torch.distributed.fsdp.fully_shard) routes each sharded module's inputs and outputs through
# RegisterPostBackwardFunction: its backward returns the gradients unchanged after running the
# module's post-backward hooks (the reduce-scatter of the parameters' gradients); it saves nothing.
register_passthrough_node("RegisterPostBackwardFunctionBackward")
