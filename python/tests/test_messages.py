"""What filter_backward says when it refuses, and that a refusal leaves the graph as it was.

One test per message: each asserts that the text names the cause (and the fix where there is one)
and carries no C++ backtrace. Then every refusal of filter_backward, in one list, is followed by a
plain loss.backward() that must equal the dense (loss_only) gradient of the same loss: a refused
step can still be taken. Also: a loss scaled by a constant (gradient accumulation, loss / n) is
accepted by a plan traced on the unscaled loss, and validate=True, which runs the step against
mask_backward inside the call, passes a right step and refuses a loss the cheap checks cannot see.
Tiny random Llama (float64), T = 37, B = 3.
  pytest python/tests/test_messages.py
"""
import pytest
import torch

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, tiny_model

B, T = 3, 37
MAX_MESSAGE = 420  # characters: a message to read, not a dump


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "eager")


@pytest.fixture(scope="module")
def plan(model):
    return chf.trace_plan(model, loss="per_token")


@pytest.fixture(scope="module")
def labels_plan(model):
    gen = torch.Generator().manual_seed(1)

    def loss_on_random_batch(b, t):
        ids = torch.randint(0, 128, (b, t), generator=gen)
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return collider.trace_plan(loss_on_random_batch)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (B, T), generator=gen)
    keep = collider.select_tokens(torch.rand(B, T, generator=gen), 0.4, valid=chf.keep_mask_from_labels(ids))
    return ids, keep


def per_token(model, ids, keep):
    return chf.masked_mean(chf.token_losses(model(input_ids=ids, use_cache=False).logits, ids), keep)


def message(call) -> str:
    with pytest.raises(collider.Error) as e:
        call()
    text = str(e.value)
    assert len(text) <= MAX_MESSAGE and "frame #" not in text and "Exception raised from" not in text, text
    return text


def test_filtering_twice(model, plan):
    ids, keep = batch()
    loss = per_token(model, ids, keep)
    collider.filter_backward(loss, keep, plan)
    text = message(lambda: collider.filter_backward(loss, keep, plan))
    assert "already rewritten" in text and "once per loss" in text, text


def test_filtering_after_backward(model, plan):
    ids, keep = batch()
    loss = per_token(model, ids, keep)
    loss.backward()
    text = message(lambda: collider.filter_backward(loss, keep, plan))
    assert "loss.backward() already ran" in text and "before loss.backward()" in text, text


def test_keep_mask_of_the_wrong_shape_is_named(model, plan):
    ids, keep = batch()
    loss = per_token(model, ids, keep)
    text = message(lambda: collider.filter_backward(loss, torch.ones(B, T + 3, dtype=torch.bool), plan))
    assert f"the keep mask is [{B}, {T + 3}] but the loss was computed on [{B}, {T}]" in text, text
    assert "plan" not in text, text


def test_all_dropped_mask_says_what_to_do(model, plan):
    ids, keep = batch()
    text = message(lambda: collider.filter_backward(per_token(model, ids, keep), torch.zeros_like(keep), plan))
    assert "keeps no token" in text and "skip this step" in text, text


def test_padded_rows_under_per_sequence_suggest_batch_topk():
    scores = torch.rand(3, 40)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, 30:] = False  # a right-padded row
    valid[2, :4] = False   # a left-padded row
    text = message(lambda: collider.select_tokens(scores, 0.4, valid=valid))
    assert "[40, 30, 36]" in text and 'policy="batch_topk"' in text and "\n" not in text, text


def test_unmasked_per_token_loss_is_refused(model):
    unmasked_plan = collider.trace_plan(
        lambda b, t: chf.token_losses(model(input_ids=(x := torch.randint(0, 128, (b, t))), use_cache=False).logits,
                                      x).mean())
    ids, keep = batch()
    loss = chf.token_losses(model(input_ids=ids, use_cache=False).logits, ids).mean()
    text = message(lambda: collider.filter_backward(loss, keep, unmasked_plan))
    assert "the loss counts positions the keep mask drops" in text and "masked_mean" in text, text


def test_unmasked_labels_loss_is_refused(model, labels_plan):
    ids, keep = batch()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    text = message(lambda: collider.filter_backward(loss, keep, labels_plan))
    assert "the loss counts positions the keep mask drops" in text and "ignore_index -100" in text, text
    assert "drop_labels" in text, text


def test_keep_mask_on_label_positions_is_refused(model, labels_plan):
    """The mask of the kept labels handed over as it is, not shifted onto the hidden states' positions."""
    ids, keep = batch()
    keep_labels = torch.zeros_like(keep)
    keep_labels[:, 1:] = keep[:, :-1]  # keep_labels[t]: label t kept (it is predicted at position t - 1)
    loss = model(input_ids=ids, labels=ids.masked_fill(~keep_labels, -100), use_cache=False).loss
    text = message(lambda: collider.filter_backward(loss, keep_labels, labels_plan))
    assert "shifted by one" in text and "keep_labels[:, t + 1]" in text, text


class SavesItsInputReversed(torch.autograd.Function):
    """A custom op that saves a token-shaped tensor and reads it in reverse order of positions."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x.flip(1)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x.flip(1) * g


def test_custom_function_mixing_token_rows_runs_whole_and_is_refused_when_registered(model):
    def loss_on_random_batch(b, t):
        ids = torch.randint(0, 128, (b, t))
        logits = SavesItsInputReversed.apply(model(input_ids=ids, use_cache=False).logits)
        return chf.masked_mean(chf.token_losses(logits, ids), chf.keep_mask_from_labels(ids))

    plan = collider.trace_plan(loss_on_random_batch)  # not row to row on the traced batch: it runs whole
    assert "SavesItsInputReversedBackward 4" in plan.to_string(), plan.to_string()
    # Declared passthrough, it is not run, and a node that saves token rows is refused.
    collider.register_passthrough_node("SavesItsInputReversedBackward")
    text = message(lambda: collider.trace_plan(loss_on_random_batch))
    assert "does not make that safe" in text, text


def test_compiled_loss_function_is_refused(model):
    compiled_loss = torch.compile(lambda logits, ids: chf.token_losses(logits, ids).sum(), backend="aot_eager")

    def loss_on_random_batch(b, t):
        ids = torch.randint(0, 128, (b, t))
        return compiled_loss(model(input_ids=ids, use_cache=False).logits, ids)

    text = message(lambda: collider.trace_plan(loss_on_random_batch))
    assert "torch.compile" in text and "CompiledFunction" in text, text


def test_compiled_autograd_is_refused(model, plan):
    import torch._dynamo
    ids, keep = batch()
    loss = per_token(model, ids, keep)
    with torch._dynamo.config.patch(compiled_autograd=True):
        text = message(lambda: collider.filter_backward(loss, keep, plan))
    assert "compiled autograd" in text and "compiled_autograd" in text, text


def test_scaled_loss_is_accepted(model, plan):
    """loss / n (gradient accumulation, a token count) before or after filter_backward: the plan traced
    on the unscaled loss serves it, and the gradient is the filtered one, scaled."""
    ids, keep = batch(3)
    model.zero_grad(set_to_none=True)
    loss = per_token(model, ids, keep)
    collider.filter_backward(loss, keep, plan)
    loss.backward()
    unscaled = grads(model)
    for scale in (lambda x: x / 4, lambda x: x * torch.tensor(0.25, dtype=x.dtype), lambda x: -(-x * 0.25)):
        model.zero_grad(set_to_none=True)
        loss = scale(per_token(model, ids, keep))
        collider.filter_backward(loss, keep, plan)
        loss.backward()
        got = grads(model)
        assert max_rel_diff(got, {k: v / 4 for k, v in unscaled.items()}) <= 1e-12


def test_validate_passes_a_right_step(model, plan):
    ids, keep = batch(4)
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = per_token(model, ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        plain = grads(model)
        model.zero_grad(set_to_none=True)
        loss = per_token(model, ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention, validate=True)
        loss.backward()
        assert max_rel_diff(grads(model), plain) == 0.0, attention


def squares_loss(model, ids):
    """A loss over every position that no cheap check reads (no cross-entropy, no per-position tensor)."""
    return (model(input_ids=ids, use_cache=False).logits ** 2).mean()


def test_validate_refuses_what_the_cheap_checks_miss(model):
    plan = collider.trace_plan(lambda b, t: squares_loss(model, torch.randint(0, 128, (b, t))))
    ids, keep = batch(5)
    collider.filter_backward(squares_loss(model, ids), keep, plan, check_every=0)  # the cheap checks pass it
    text = message(lambda: collider.filter_backward(squares_loss(model, ids), keep, plan, validate=True))
    assert "differs from mask_backward's" in text and "graph is unchanged" in text, text
    # The check on first use, by default, refuses it too, naming where the gradients part.
    text = message(lambda: collider.filter_backward(squares_loss(model, ids), keep, plan))
    assert "differs from mask_backward's, first at node MmBackward0" in text, text  # the LM head's


# Every refusal of filter_backward, each on a fresh loss: (name, plan fixture, make the loss, the call).
def refusals(model, plan, labels_plan):
    ids, keep = batch(6)

    def per_token_loss():
        return per_token(model, ids, keep)

    def unmasked_labels_loss():
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return [
        ("wrong-shape mask", per_token_loss, lambda l: collider.filter_backward(l, torch.ones(B, T + 1, dtype=torch.bool), plan)),
        ("all dropped", per_token_loss, lambda l: collider.filter_backward(l, torch.zeros_like(keep), plan)),
        ("unmasked labels loss", unmasked_labels_loss, lambda l: collider.filter_backward(l, keep, labels_plan)),
        ("plan of another loss", unmasked_labels_loss, lambda l: collider.filter_backward(l, keep, plan)),
        ("validate", lambda: squares_loss(model, ids), lambda l: collider.filter_backward(
            l, keep, collider.trace_plan(lambda b, t: squares_loss(model, torch.randint(0, 128, (b, t)))),
            validate=True)),
        ("compiled autograd", per_token_loss, lambda l: with_compiled_autograd(
            lambda: collider.filter_backward(l, keep, plan))),
    ]


def with_compiled_autograd(call):
    import torch._dynamo
    with torch._dynamo.config.patch(compiled_autograd=True):
        call()


def test_every_refusal_leaves_the_graph_unchanged(model, plan, labels_plan):
    for name, make_loss, call in refusals(model, plan, labels_plan):
        model.zero_grad(set_to_none=True)
        make_loss().backward()
        dense = grads(model)
        model.zero_grad(set_to_none=True)
        loss = make_loss()
        with pytest.raises(collider.Error):
            call(loss)
        loss.backward()
        assert max_rel_diff(grads(model), dense) == 0.0, name


def test_autocast_that_differs_from_the_trace_is_named():
    """A plan traced in float32 used for a step under torch.autocast(bfloat16): the message says to
    trace under the same autocast; a plan traced both ways (merged) serves both."""
    model = tiny_model("llama", "sdpa", dtype=torch.float32, initializer_range=0.02)
    plan = chf.trace_plan(model, loss="per_token")
    ids, keep = batch(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = per_token(model, ids, keep)
    text = message(lambda: collider.filter_backward(loss, keep, plan))
    assert "autocast" in text and "ToCopyBackward0" in text, text
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan.merge(chf.trace_plan(model, loss="per_token"))
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = per_token(model, ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        got = grads(model)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = per_token(model, ids, keep)
        collider.mask_backward(loss, keep, plan, attention=attention)
        loss.backward()
        assert max_rel_diff(got, grads(model)) <= 2e-2, attention
