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
logits, as transformers' models do without it, or, with fused_head=True (off by default), scores
every token through Collider's fused head (collider.hf.score_tokens) with no [B, T, V] logits and
backpropagates only the kept ones.
method: "collider", "loss_only" (the same selection, dense backward) or "regular" (every labelled
token; no reference model needed). Tests: python/tests/test_trl.py.
"""
from __future__ import annotations

from typing import Optional

import torch

import collider.hf as _hf
from collider import Error

try:
    import trl as _trl
except ImportError:  # pragma: no cover - collider without trl
    _trl = None

__all__ = ["Rho1SFTTrainer"]

# What TRL's collators hand the model besides labels (the flash-attention keywords of packed rows
# are passed on as they are; SDPA and eager build their mask from position_ids).
_NOT_FORWARD = ("labels", "completion_mask", "assistant_masks")


if _trl is not None:

    class Rho1SFTTrainer(_hf.Rho1Selection, _trl.SFTTrainer):
        """trl.SFTTrainer with RHO-1 selection and Collider's filtered backward (module docstring).
        The last step's keep mask and FilterStats are in `last_keep_mask` and `last_filter_stats`."""

        def __init__(self, *args, reference_model: Optional[torch.nn.Module] = None, filter_ratio: float = 0.4,
                     method: str = "collider", attention: str = "kept_only", policy: str = "batch_topk",
                     align: int = 8, fused_head: bool = False, **kwargs):
            self._check_rho1_arguments("Rho1SFTTrainer", reference_model, filter_ratio, method, attention, policy)
            super().__init__(*args, **kwargs)
            self._init_rho1(reference_model, filter_ratio, method, attention, policy, align,
                            "fused_head" if fused_head else "per_token")

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            forward = {k: v for k, v in inputs.items() if k not in _NOT_FORWARD}
            forward["use_cache"] = False
            return self._rho1_loss(model, forward, inputs["labels"], return_outputs, num_items_in_batch)

else:  # pragma: no cover

    class Rho1SFTTrainer:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise Error("collider.trl.Rho1SFTTrainer needs trl (pip install trl)")
