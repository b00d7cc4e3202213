"""The trainers users run, with activation checkpointing on as they default to it: every step's
filtered gradient equals the oracle at that step's weights.

- collider.hf.Rho1Trainer with TrainingArguments(gradient_checkpointing=True), 3 steps, on Llama
  and on a mixture of experts (Mixtral, eager experts: its routes behind checkpointing run on all
  their rows, collider_core/src/routes.h; 3 fresh models);
- TRL's SFTTrainer with its defaults (SFTConfig's gradient_checkpointing=True, its collator and
  loss scaling), 3 steps, with the compute_loss docs/PYTHON.md gives (RHO-1 selection, the per-token
  loss, filter_backward), on a tokenized dataset of equal-length rows; Llama, and Mixtral on 3 fresh
  models.
Tiny random Llama (float64), eager and sdpa, both semantics, B = 3, T = 37, 40% filtered, each
case on 8 fresh models (seeds 0-7). A spy records each step's batch, keep mask, weights before the
step and the gradient its backward produced; the oracle (oracle.py, checkpointing off) is then
computed on a fresh model with those weights.
  pytest python/tests/test_trainers_checkpointing.py
"""
import pytest
import torch

import collider
import collider.hf as chf
from oracle import max_rel_diff, model_oracle, tiny_model

B, T, RATIO, STEPS = 3, 37, 0.4, 3
SEEDS = range(8)
TOL = 1e-4
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


class Windows(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def spy_on(trainer, model, steps: list):
    """Records, per training step, the weights before it and the gradient its backward left."""
    real_backward = trainer.accelerator.backward

    def backward(loss, **kwargs):
        real_backward(loss, **kwargs)
        steps[-1]["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    trainer.accelerator.backward = backward


def oracle_grads(family, attn, params, ids, keep, attention, loss_form):
    model = tiny_model(family, attn)  # no checkpointing
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    names = [n for n, _ in model.named_parameters()]
    with model_oracle(model, keep, attention):
        loss = chf.training_loss(model, ids, ids, keep, loss=loss_form)
        return dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


def check_steps(steps, family, attn, attention, loss_form, label):
    assert len(steps) == STEPS, f"{label}: {len(steps)} steps recorded"
    worst = []
    for k, s in enumerate(steps):
        assert s["stats"].tensors_hooked > 0, f"{label} step {k}: checkpointing was off"
        ref = oracle_grads(family, attn, s["params"], s["ids"], s["keep"], attention, loss_form)
        worst.append(max_rel_diff(s["grads"], ref))
    assert all(w <= TOL for w in worst), f"{label}: per-step max relative difference {worst}"


@pytest.mark.parametrize("attention", ["kept_only", "exact_query"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_rho1_trainer_with_checkpointing_matches_oracle(tmp_path, family, attn, attention):
    from transformers import TrainingArguments

    for seed in SEEDS if family == "llama" else range(3):
        steps = []

        class Spy(chf.Rho1Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                if model.training:
                    steps.append({"ids": inputs["input_ids"].clone(),
                                  "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
                out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                if model.training:
                    steps[-1].update(keep=self.last_keep_mask.clone(), stats=self.last_filter_stats)
                return out

        model = tiny_model(family, attn, seed=seed)
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=B, max_steps=STEPS,
                                 learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0, seed=seed, gradient_checkpointing=True,
                                 logging_strategy="no")
        trainer = Spy(model=model, args=args, train_dataset=Windows(B * STEPS, seed),
                      reference_model=tiny_model(family, attn, seed=100 + seed), filter_ratio=RATIO,
                      attention=attention)
        spy_on(trainer, model, steps)
        trainer.train()
        check_steps(steps, family, attn, attention, "labels", f"Rho1Trainer {family} seed {seed}")


def tiny_tokenizer():
    """A word-level tokenizer over the 128 ids of the tiny models ("t0" .. "t127"), for TRL's checks."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2")


@pytest.mark.parametrize("attention", ["kept_only", "exact_query"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_trl_sft_trainer_with_its_defaults_matches_oracle(tmp_path, family, attn, attention):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    for seed in SEEDS if family == "llama" else range(3):
        steps = []

        class Rho1SFTTrainer(trl.SFTTrainer):
            """docs/PYTHON.md's compute_loss: RHO-1 selection (random scores stand in for the excess loss)."""

            plan = None

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                ids, labels = inputs["input_ids"], inputs["labels"]
                if self.plan is None:
                    self.plan = chf.trace_plan(model, loss="per_token")
                steps.append({"ids": ids.clone(),
                              "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
                logits = model(input_ids=ids, use_cache=False).logits
                scores = torch.rand(ids.shape, generator=torch.Generator().manual_seed(len(steps)))
                keep = collider.select_tokens(scores, RATIO, valid=chf.keep_mask_from_labels(labels))
                loss = chf.masked_mean(chf.token_losses(logits, labels), keep)
                steps[-1].update(keep=keep, stats=collider.filter_backward(loss, keep, self.plan, attention=attention))
                return loss

        model = tiny_model(family, attn, seed=seed)
        rows = torch.randint(0, 128, (B * STEPS, T), generator=torch.Generator().manual_seed(seed)).tolist()
        args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=B, max_steps=STEPS,
                             learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0, seed=seed, logging_strategy="no")
        assert args.gradient_checkpointing, "TRL's default changed: this test is about its default"
        trainer = Rho1SFTTrainer(model=model, args=args, processing_class=tiny_tokenizer(),
                                 train_dataset=datasets.Dataset.from_dict({"input_ids": rows}))
        spy_on(trainer, model, steps)
        trainer.train()
        check_steps(steps, family, attn, attention, "per_token", f"SFTTrainer {family} seed {seed}")
