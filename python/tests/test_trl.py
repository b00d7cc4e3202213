"""collider.trl.Rho1SFTTrainer: TRL's SFTTrainer with its defaults and Collider, every step exact.

TRL 1.16's SFTTrainer on rows of different lengths, three collations: plain padding (an
attention_mask), padding_free=True (the batch as one row, position_ids restarting per sequence)
and packing=True (sequences packed into rows of at most 48 positions, likewise); SDPA, gradient
checkpointing on (SFTConfig's default), 3 steps each, both semantics, RHO-1's batch_topk against a
reference model; and a LoRA adapter (peft_config) with plain padding. A spy records each step's
inputs, keep mask, weights before the step, the step's kept count (num_items_in_batch) and the
gradient its backward left; the oracle (oracle.py, a model without checkpointing with those
weights, the same inputs and mask) gives the gradient of the same normalised loss. Tiny random
Llama, float64; max relative difference <= 1e-4. With fused_head=True (Collider's fused LM head,
no [B, T, V] logits) against the same oracle, padding-free and packed.
  pytest python/tests/test_trl.py
"""
import pytest
import torch

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, oracle_keep, tiny_model
from test_trainers_checkpointing import tiny_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
import collider.trl as ctrl  # noqa: E402

STEPS, BATCH = 3, 3
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
COLLATIONS = {"padding": {}, "padding_free": {"padding_free": True, "max_length": None},
              "packing": {"packing": True, "max_length": 48}}


def rows(seed: int, n: int = 12):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 36, (n,), generator=gen).tolist()
    return [torch.randint(3, 128, (k,), generator=gen).tolist() for k in lengths]


def run(tmp_path, collation: str, attention: str, seed: int, peft_config=None, fused_head=False):
    steps = []

    class Spy(ctrl.Rho1SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                steps.append({"inputs": {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()},
                              "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                              "count": num_items_in_batch})
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                steps[-1].update(keep=self.last_keep_mask.clone(), stats=self.last_filter_stats)
            return out

    model = tiny_model("llama", "sdpa", seed=seed)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS,
                         learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                         disable_tqdm=True, dataloader_num_workers=0, seed=seed, logging_strategy="no",
                         **COLLATIONS[collation])
    assert args.gradient_checkpointing
    trainer = Spy(model=model, args=args, processing_class=tiny_tokenizer(), peft_config=peft_config,
                  train_dataset=datasets.Dataset.from_dict({"input_ids": rows(seed)}),
                  reference_model=tiny_model("llama", "sdpa", seed=100 + seed), filter_ratio=0.4, attention=attention,
                  fused_head=fused_head)
    trained = trainer.model
    real_backward = trainer.accelerator.backward

    def backward(loss, **kwargs):
        real_backward(loss, **kwargs)
        steps[-1]["grads"] = {n: p.grad.detach().clone() for n, p in trained.named_parameters() if p.grad is not None}

    trainer.accelerator.backward = backward
    trainer.train()
    return trainer, steps


def oracle_grads(step, attention, peft_config):
    model = tiny_model("llama", "sdpa")
    if peft_config is not None:
        import peft
        model = peft.get_peft_model(model, peft_config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(step["params"][n])
    inputs = step["inputs"]
    forward = {k: v for k, v in inputs.items() if k != "labels"}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    with oracle_keep(model, step["keep"], attention):
        logits = model(**forward, use_cache=False).logits
        loss = chf.masked_mean(chf.token_losses(logits, inputs["labels"]), step["keep"], step["count"])
        got = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return dict(zip(names, got))


@pytest.mark.parametrize("attention", ["kept_only", "exact_query"])
@pytest.mark.parametrize("collation", list(COLLATIONS))
def test_sft_trainer_steps_match_oracle(tmp_path, collation, attention):
    trainer, steps = run(tmp_path, collation, attention, seed=0)
    assert len(steps) == STEPS
    if collation != "padding":
        assert steps[0]["inputs"]["input_ids"].shape[0] == 1 and "position_ids" in steps[0]["inputs"]
    worst = []
    for s in steps:
        assert s["stats"] is not None and s["stats"].tensors_hooked > 0  # filtered, with checkpointing
        assert int(s["count"]) == int(s["keep"].sum())  # the step's count is what was kept
        worst.append(max_rel_diff(s["grads"], oracle_grads(s, attention, None)))
    assert all(w <= 1e-4 for w in worst), f"{collation}/{attention}: {worst}"


def test_sft_trainer_with_lora_matches_oracle(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    trainer, steps = run(tmp_path, "padding", "kept_only", seed=1, peft_config=config)
    for s in steps:
        assert s["grads"] and all("lora" in n for n in s["grads"])
        assert max_rel_diff(s["grads"], oracle_grads(s, "kept_only", config)) <= 1e-4


@pytest.mark.parametrize("collation", ["padding_free", "packing"])
def test_sft_trainer_with_the_fused_head_matches_oracle(tmp_path, collation):
    trainer, steps = run(tmp_path, collation, "exact_query", seed=2, fused_head=True)
    assert len(steps) == STEPS
    worst = [max_rel_diff(s["grads"], oracle_grads(s, "exact_query", None)) for s in steps]
    assert all(s["stats"] is not None and s["stats"].tensors_hooked > 0 for s in steps)
    assert all(w <= 1e-4 for w in worst), f"{collation}: {worst}"
