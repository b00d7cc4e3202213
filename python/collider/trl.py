"""collider.trl: RHO-1 token selection with Collider's filtered backward in TRL's SFTTrainer.

    trainer = collider.trl.Rho1SFTTrainer(model=model, reference_model=ref, args=trl.SFTConfig(...),
                                          train_dataset=ds, filter_ratio=0.4, attention="kept_only")
    trainer.train()

TRL's defaults stay as they are: its collators (plain padding, padding_free, packing: one row of
sequences with restarting position_ids), SDPA, gradient checkpointing (SFTConfig turns it on), a
PEFT LoRA adapter (peft_config), its data handling. What changes is the loss: every step, the
model's per-token loss and the reference model's (no grad, same inputs) give the excess loss;
collider.select_tokens keeps the top (1 - filter_ratio) of the batch (policy "batch_topk", RHO-1's
own, default: rows of different lengths keep different counts) or of every row ("per_sequence");
the loss is the kept tokens' summed loss over the kept tokens of the whole optimizer step (every
micro-batch and, with average_tokens_across_devices, every rank: TRL's num_items_in_batch, counted
for the kept tokens), and collider.filter_backward rewrites the graph before Trainer's backward.
TRL's own loss runs a fused LM head that returns only log-probabilities; this one computes the
logits, as transformers' models do without it.
method: "collider", "loss_only" (the same selection, dense backward) or "regular" (every labelled
token; no reference model needed). Tests: python/tests/test_trl.py.
"""
from __future__ import annotations

from typing import Optional

import torch

import collider as _collider
import collider.hf as _hf
from collider import Error, Plan

try:
    import trl as _trl
except ImportError:  # pragma: no cover - collider without trl
    _trl = None

__all__ = ["Rho1SFTTrainer"]

# What TRL's collators hand the model besides labels (the flash-attention keywords of packed rows
# are passed on as they are; SDPA and eager build their mask from position_ids).
_NOT_FORWARD = ("labels", "completion_mask", "assistant_masks")


if _trl is not None:

    class Rho1SFTTrainer(_trl.SFTTrainer):
        """trl.SFTTrainer with RHO-1 selection and Collider's filtered backward (module docstring).
        The last step's keep mask and FilterStats are in `last_keep_mask` and `last_filter_stats`."""

        def __init__(self, *args, reference_model: Optional[torch.nn.Module] = None, filter_ratio: float = 0.4,
                     method: str = "collider", attention: str = "kept_only", policy: str = "batch_topk",
                     align: int = 8, **kwargs):
            if method not in _hf.METHODS:
                raise Error(f"Rho1SFTTrainer: method must be one of {', '.join(_hf.METHODS)}; got {method!r}")
            if attention not in ("kept_only", "exact_query"):
                raise Error(f"Rho1SFTTrainer: attention must be kept_only or exact_query; got {attention!r}")
            if policy not in ("per_sequence", "batch_topk"):
                raise Error(f"Rho1SFTTrainer: policy must be per_sequence or batch_topk; got {policy!r}")
            if method != "regular" and reference_model is None:
                raise Error("Rho1SFTTrainer: RHO-1 selection needs a reference_model (trained on the curated data); "
                            "use method='regular' to train on every token")
            if not 0.0 <= float(filter_ratio) < 1.0:
                raise Error(f"Rho1SFTTrainer: filter_ratio {filter_ratio} is outside [0, 1): it is the fraction dropped")
            super().__init__(*args, **kwargs)
            self.reference_model = reference_model
            if reference_model is not None:
                reference_model.eval()
                reference_model.requires_grad_(False)
            self.filter_ratio, self.method, self.attention = float(filter_ratio), method, attention
            self.policy, self.align = policy, int(align)
            # The loss is normalised by the step's kept count: Trainer must not divide it again.
            self.model_accepts_loss_kwargs = False
            self.loss_is_scaled_for_ga = True
            self.collider_plan: Optional[Plan] = None
            self.last_keep_mask: Optional[torch.Tensor] = None
            self.last_filter_stats = None

        def _get_num_items_in_batch(self, batch_samples, device):
            """The kept tokens of the optimizer step (what the selection keeps of each micro-batch, known
            from its labels), summed over micro-batches and, with average_tokens_across_devices, ranks."""
            valid = [_hf.keep_mask_from_labels(b["labels"]) for b in batch_samples]
            if self.method == "regular":
                total = sum(int(v.sum()) for v in valid)
            else:
                total = sum(_collider.kept_total(v, self.filter_ratio, self.policy, self.align) for v in valid)
            count = torch.tensor(total, dtype=torch.int64, device=device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                count = self.accelerator.gather(count).sum()
            return count

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"]
            forward = {k: v for k, v in inputs.items() if k not in _NOT_FORWARD}
            forward["use_cache"] = False
            training = model.training and torch.is_grad_enabled()
            if training and self.method == "collider" and self.collider_plan is None:
                self.collider_plan = _hf.trace_plan(model, loss="per_token")  # once, before the first step
            outputs = model(**forward)
            logits = outputs.logits
            valid = _hf.keep_mask_from_labels(labels).to(logits.device)
            if self.method == "regular" or not training:
                keep = valid
            else:
                with torch.no_grad():
                    mine = _hf.token_losses(logits.detach(), labels)
                    reference = self.reference_model
                    if next(reference.parameters()).device != logits.device:
                        reference.to(logits.device)
                    ref = _hf.token_losses(reference(**forward).logits, labels)
                keep = _collider.select_tokens(mine - ref, self.filter_ratio, policy=self.policy, align=self.align,
                                               valid=valid)
            step_count = num_items_in_batch if training else None
            loss = _hf.masked_mean(_hf.token_losses(logits, labels), keep, step_count)
            if step_count is not None and self.args.average_tokens_across_devices and self.args.world_size > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages over ranks; the count spans them
            if training:
                self.last_keep_mask = keep
                if self.method == "collider" and bool(keep.any()):
                    # The one added line; Trainer.training_step's accelerator.backward(loss) follows.
                    self.last_filter_stats = _collider.filter_backward(loss, keep, self.collider_plan,
                                                                       attention=self.attention)
            return (loss, outputs) if return_outputs else loss

else:  # pragma: no cover

    class Rho1SFTTrainer:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise Error("collider.trl.Rho1SFTTrainer needs trl (pip install trl)")
