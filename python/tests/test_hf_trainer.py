"""collider.hf.Rho1Trainer: RHO-1 with transformers' Trainer really runs Collider's backward.

One Trainer step on a tiny Llama (float64): spies record that collider.filter_backward runs on the
step's loss before Trainer's accelerator.backward, that the keep mask is RHO-1's per-sequence
selection of the excess loss against the reference model, and that the gradients the backward
produced equal the independent oracle's (oracle.py) for that mask, for both loss forms and both
semantics; method="loss_only" never calls filter_backward and gives the dense masked gradient.
  pytest python/tests/test_hf_trainer.py
"""
import pytest
import torch
from torch.utils.data import Dataset
from transformers import TrainingArguments

import collider
import collider.hf as chf
from oracle import max_rel_diff, oracle_keep, tiny_model

T = 37
B = 3


class Windows(Dataset):
    def __init__(self, n, seed=0):
        self.ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def run_one_step(tmp_path, monkeypatch, **trainer_kwargs):
    model = tiny_model("llama", "sdpa")
    reference = tiny_model("llama", "sdpa", seed=1)
    events, seen = [], {}
    real_filter = collider.filter_backward

    def spy_filter(loss, keep, plan, attention="kept_only"):
        events.append(("filter_backward", loss))
        return real_filter(loss, keep, plan, attention=attention)

    monkeypatch.setattr(collider, "filter_backward", spy_filter)

    class SpyTrainer(chf.Rho1Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen["input_ids"] = inputs["input_ids"].clone()
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=B, max_steps=1, learning_rate=1e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    trainer = SpyTrainer(model=model, args=args, train_dataset=Windows(B), reference_model=reference,
                         **trainer_kwargs)
    real_backward = trainer.accelerator.backward

    def spy_backward(loss, **kwargs):
        # the loss Trainer backpropagates is the rewritten one (or a scalar op on top of it)
        events.append(("backward", loss))
        real_backward(loss, **kwargs)
        seen["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        seen["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    trainer.accelerator.backward = spy_backward
    trainer.train()
    return trainer, model, reference, events, seen


def expected_keep(model_params, model, reference, ids, filter_ratio, policy):
    with torch.no_grad():
        mine = chf.token_losses(model(input_ids=ids, use_cache=False).logits, ids)
        ref = chf.token_losses(reference(input_ids=ids, use_cache=False).logits, ids)
    return collider.select_tokens(mine - ref, filter_ratio, policy=policy, valid=chf.keep_mask_from_labels(ids))


def reference_grads(model, params, ids, keep, loss_form, attention):
    """Gradients at the pre-step weights: oracle for Collider, plain autograd for loss_only."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    names = [n for n, _ in model.named_parameters()]
    if attention is None:
        loss = chf.training_loss(model, ids, ids, keep, loss=loss_form)
        return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    with oracle_keep(model, keep, attention):
        loss = chf.training_loss(model, ids, ids, keep, loss=loss_form)
        return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


@pytest.mark.parametrize("loss_form, attention, policy", [("labels", "kept_only", "per_sequence"),
                                                          ("per_token", "exact_query", "per_sequence"),
                                                          ("labels", "exact_query", "batch_topk")])
def test_trainer_step_runs_collider_before_backward(tmp_path, monkeypatch, loss_form, attention, policy):
    trainer, model, reference, events, seen = run_one_step(tmp_path, monkeypatch, filter_ratio=0.5,
                                                           attention=attention, loss=loss_form, policy=policy)
    assert [e[0] for e in events] == ["filter_backward", "backward"], events
    filtered, backpropagated = events[0][1], events[1][1]
    # Trainer divides by the accumulation steps: the backward's loss is the filtered one or one op on top of it
    assert backpropagated is filtered or any(e[0] is not None and e[0] is filtered.grad_fn
                                             for e in backpropagated.grad_fn.next_functions)
    stats = trainer.last_filter_stats
    assert stats.batch == B and stats.tensors_gathered > 0
    if policy == "per_sequence":
        assert stats.kept == collider.kept_count(T - 1, 0.5) and stats.kept_total == B * stats.kept
    else:
        assert stats.kept_total == int(trainer.last_keep_mask.sum())
    ids = seen["input_ids"]
    keep = trainer.last_keep_mask
    # the keep mask is RHO-1's: per_sequence top excess loss against the reference model
    model_now = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(seen["params"][n])
    assert torch.equal(keep, expected_keep(seen["params"], model, reference, ids, 0.5, policy))
    ref = reference_grads(model, seen["params"], ids, keep, loss_form, attention)
    assert max_rel_diff(seen["grads"], ref) <= 1e-4
    # and the step changed the weights
    assert any(not torch.equal(model_now[n], seen["params"][n]) for n in model_now)


def test_trainer_loss_only_never_filters(tmp_path, monkeypatch):
    trainer, model, reference, events, seen = run_one_step(tmp_path, monkeypatch, filter_ratio=0.5,
                                                           method="loss_only")
    assert [e[0] for e in events] == ["backward"]
    ids, keep = seen["input_ids"], trainer.last_keep_mask
    assert int(keep.sum()) == B * collider.kept_count(T - 1, 0.5)
    ref = reference_grads(model, seen["params"], ids, keep, "labels", None)
    assert max_rel_diff(seen["grads"], ref) <= 1e-10


def test_trainer_argument_checks(tmp_path):
    model = tiny_model("llama", "eager")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(collider.Error, match="reference_model"):
        chf.Rho1Trainer(model=model, args=args, train_dataset=Windows(3))
    with pytest.raises(collider.Error, match="attention"):
        chf.Rho1Trainer(model=model, args=args, train_dataset=Windows(3), reference_model=model, attention="all")
    with pytest.raises(collider.Error, match="policy"):
        chf.Rho1Trainer(model=model, args=args, train_dataset=Windows(3), reference_model=model, policy="top")
    with pytest.raises(collider.Error, match="filter_ratio"):
        chf.Rho1Trainer(model=model, args=args, train_dataset=Windows(3), reference_model=model, filter_ratio=1.5)
