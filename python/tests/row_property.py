"""The row property of the node types collider cuts, run on PyTorch's own sample inputs (OpInfo).

collider cuts a node along a token dimension only under a rule that says the node acts row by row
there (collider_core/src/row_rules.h; `collider.row_rules()`). This module checks the claim: for
every OpInfo operator (torch.testing._internal.common_methods_invocations.op_db) whose autograd
graph is one node of a type collider cuts, on its float64 CPU sample inputs, and for every
dimension d of its first input along which the node's rule lets collider cut:
  - every output element depends on at most one row of the input along d (its Jacobian has one
    nonzero row block per output element), so cutting rows never mixes two;
  - changing one row k leaves every other row's outputs and every other row's input gradient
    (its Jacobian columns) unchanged, so a kept row's gradient never needs a dropped row's values.
Which dimensions a rule lets collider cut (the rule's words, DESIGN.md section 4):
  pointwise, layout: every dimension; along dim: those that are not its `dim` / `dims`;
  reduction: those it does not reduce; norm: those before its normalized_shape;
  matmul: every dimension of the first operand but its inner (last) one; repeat: those repeated once.
lookup and attention are cut only inside the structures trace_plan recognises (routes, attention
cores) and are checked on whole models instead (test_moe.py, test_hf_gradients.py).
Used by test_row_rules.py and row_rules_table.py (docs/ROW_RULES.md).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

import collider

CUT_RULES = ("pointwise", "layout", "along dim", "reduction", "norm", "matmul", "repeat")
# Operators whose result is random: their Jacobian changes from call to call.
RANDOM = ("dropout", "bernoulli", "normal", "rand", "multinomial", "uniform", "poisson", "exponential",
          "geometric", "cauchy", "log_normal")
MAX_INPUT = 400     # elements of the input whose Jacobian is computed
MAX_OUTPUT = 1600   # elements of the output
SAMPLES = 4         # sample inputs per operator


@dataclass
class Outcome:
    proven: dict = field(default_factory=dict)       # node type -> {operator names}
    violations: list = field(default_factory=list)   # (operator, node type, dim, what)
    checked: int = 0                                 # (operator, sample, dim) triples checked


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _as_dims(value, rank: int) -> set:
    if value is None:
        return set(range(rank))
    if isinstance(value, int):
        value = (value,)
    # An int64 saved field reads back as unsigned in Python (-1 as 2**64 - 1).
    return {(d - 2**64 if d >= 2**63 else d) % rank for d in value} if rank else set()


def claimed_dims(node, rule: str, x: torch.Tensor) -> list:
    """The dimensions of x along which `rule` lets collider cut `node`."""
    r = x.dim()
    every = [d for d in range(r) if x.shape[d] >= 2]
    saved = lambda name: getattr(node, f"_saved_{name}", None)
    if rule in ("pointwise", "layout"):
        return every
    if rule == "along dim":
        along = saved("dim") if saved("dim") is not None else saved("dims")
        if along is None:
            return []
        return [d for d in every if d not in _as_dims(along, r)]
    if rule == "reduction":
        has_dim = any(a == "_saved_dim" for a in dir(node))
        return [d for d in every if d not in _as_dims(saved("dim") if has_dim else None, r)]
    if rule == "norm":
        shape = saved("normalized_shape") or ()
        return [d for d in every if d < r - len(shape)]
    if rule == "matmul":
        return [d for d in every if d != r - 1]
    if rule == "repeat":
        reps = saved("repeats") or ()
        lead = len(reps) - r
        return [d for d in every if lead + d < len(reps) and reps[lead + d] == 1]
    return []


def _single_node(out: torch.Tensor) -> bool:
    """The graph from out to its inputs is one node (its next functions accumulate into leaves)."""
    return all(f is None or f.name() == "torch::autograd::AccumulateGrad" for f, _ in out.grad_fn.next_functions)


def _row_blocks(J: torch.Tensor, x: torch.Tensor, d: int) -> torch.Tensor:
    """J [n_out, *x.shape] -> [n_out, rows along d, rest]."""
    return J.reshape(J.shape[0], *x.shape).movedim(1 + d, 1).reshape(J.shape[0], x.shape[d], -1)


def check_operator(op, rules: dict, outcome: Outcome) -> None:
    # (__rpow__, __rmatmul__, ...: the sample's input is the second operand.)
    if not op.supports_autograd or op.name.startswith("__r") or any(w in op.name for w in RANDOM):
        return
    try:
        if torch.float64 not in op.supported_dtypes("cpu"):
            return
        samples = list(itertools.islice(op.sample_inputs("cpu", torch.float64, requires_grad=True), SAMPLES))
    except Exception:  # an operator whose samples need what this machine lacks
        return
    for s in samples:
        listed = isinstance(s.input, (list, tuple))
        x0 = s.input[0] if listed else s.input
        if not isinstance(x0, torch.Tensor) or not x0.is_floating_point() or not x0.requires_grad:
            continue
        if x0.numel() == 0 or x0.numel() > MAX_INPUT:
            continue

        def run(x):
            inp = [x, *s.input[1:]] if listed else x
            return op(inp, *s.args, **s.kwargs)

        try:
            out = run(x0)
        except Exception:
            continue
        outs = [o for o in _tensors(out) if o.grad_fn is not None and (o.is_floating_point() or o.is_complex())]
        if len(outs) != 1 or not _single_node(outs[0]):
            continue
        node = outs[0].grad_fn
        rule = rules.get(node.name())
        if rule not in CUT_RULES:
            continue
        dims = claimed_dims(node, rule, x0)
        if not dims:
            continue

        def flat(x):
            o = [t for t in _tensors(run(x)) if t.is_floating_point() or t.is_complex()][0]
            return (torch.view_as_real(o) if o.is_complex() else o).reshape(-1)

        try:
            y0 = flat(x0.detach())
            if y0.numel() > MAX_OUTPUT or not torch.equal(y0.nan_to_num(), flat(x0.detach()).nan_to_num()):
                continue  # too large, or not deterministic
            J0 = torch.autograd.functional.jacobian(flat, x0.detach())
        except Exception:
            continue
        if not bool(torch.isfinite(J0).all()):
            continue  # a NaN derivative anywhere spreads over every entry of the Jacobian's rows
        ok = True
        for d in dims:
            outcome.checked += 1
            dep0 = _row_blocks(J0, x0, d).ne(0).any(-1)  # [n_out, rows]
            if bool((dep0.sum(1) > 1).any()):
                outcome.violations.append((op.name, node.name(), d, "an output element depends on two rows"))
                ok = False
                continue
            x1 = x0.detach().clone()
            g = torch.Generator().manual_seed(d)
            x1.select(d, 0).add_(torch.rand(x1.select(d, 0).shape, generator=g, dtype=x1.dtype) + 0.5)
            try:
                y1 = flat(x1)
                J1 = torch.autograd.functional.jacobian(flat, x1)
            except Exception:
                continue
            others = dep0[:, 1:].any(1)  # outputs that depend on a row other than the changed one
            if not torch.allclose(y1[others], y0[others], rtol=1e-12, atol=1e-12, equal_nan=True):
                outcome.violations.append((op.name, node.name(), d, "changing one row moved another row's output"))
                ok = False
                continue
            b0, b1 = _row_blocks(J0, x0, d)[:, 1:], _row_blocks(J1, x1, d)[:, 1:]
            if not torch.allclose(b1, b0, rtol=1e-10, atol=1e-12, equal_nan=True):
                outcome.violations.append((op.name, node.name(), d, "changing one row moved another row's gradient"))
                ok = False
        if ok:
            outcome.proven.setdefault(node.name(), set()).add(op.name)


def run_all() -> Outcome:
    from torch.testing._internal.common_methods_invocations import op_db

    rules = {t: r for t, r, _ in collider.row_rules()}
    outcome = Outcome()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for op in op_db:
            check_operator(op, rules, outcome)
    return outcome
