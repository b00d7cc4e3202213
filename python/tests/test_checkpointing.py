"""Exact filtered gradients when saved activations are recomputed or moved: activation
checkpointing, saved-tensor hooks, offloading, PEFT LoRA with checkpointing.

Collider cuts a saved tensor to the kept rows when the backward unpacks it
(collider_core/src/saved_cut.h), so a tensor that a hook recomputes or copies back is cut where it
appears, with the same kept rows. Grid: tiny random Llama, Qwen2 and Phi3 (float64),
attn_implementation eager and sdpa, both semantics, B = 3, T = 37, 40% filtered, the per-token
loss, against the oracle (oracle.py) on the same weights with checkpointing off (max relative
difference <= 1e-4). Every case runs on 8 fresh models (seeds 0-7): a fault that depends on memory
reuse shows from run to run. Set-ups:
  transformers' gradient_checkpointing_enable() (non-reentrant, its default), checkpointing every
  second layer, selective checkpointing (create_selective_checkpoint_contexts saving the matmuls),
  checkpointing with offload to the CPU (transformers' offload=True), saved_tensors_hooks whose
  unpack returns a clone, save_on_cpu; a hand-written model with torch.utils.checkpoint around each
  block; PEFT LoRA on every linear layer with checkpointing (its embedding output becomes a leaf
  that requires grad: accumulated full-size, zero at dropped positions).
Reentrant checkpointing (use_reentrant=True) is refused at trace_plan, naming use_reentrant=False.
The trainers with checkpointing on: test_trainers_checkpointing.py.
  pytest python/tests/test_checkpointing.py
"""
import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import collider
import collider.hf as chf
from oracle import ORACLE, grads, max_rel_diff, oracle_attention, oracle_keep, tiny_model

FAMILIES = ("llama", "qwen2", "phi3")
SEEDS = range(8)
B, T, RATIO = 3, 37, 0.4
TOL = 1e-4

# transformers 5 calls gradient_checkpointing_enable a deprecated alias; it is what users call.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")


def batch(seed: int, vocab: int = 128):
    gen = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    keep = collider.select_tokens(torch.rand(B, T, generator=gen), RATIO, valid=chf.keep_mask_from_labels(ids))
    return ids, keep


def per_token_loss(model, ids, keep):
    return chf.masked_mean(chf.token_losses(model(input_ids=ids, use_cache=False).logits, ids), keep)


def random_batch_loss(model):
    """loss_on_random_batch for collider.trace_plan: the per-token loss on random ids."""
    def loss_on_random_batch(batch_size, seq_len):
        ids = torch.randint(0, 128, (batch_size, seq_len))
        return per_token_loss(model, ids, chf.keep_mask_from_labels(ids))
    return loss_on_random_batch


def filtered(model, plan, ids, keep, attention, context=contextlib.nullcontext):
    model.zero_grad(set_to_none=True)
    with context():
        loss = per_token_loss(model, ids, keep)
    stats = collider.filter_backward(loss, keep, plan, attention=attention)
    loss.backward()
    return grads(model), stats


def oracle(model, ids, keep, attention):
    model.zero_grad(set_to_none=True)
    with oracle_keep(model, keep, attention):
        per_token_loss(model, ids, keep).backward()
    return grads(model)


# How each set-up is switched on: on the model, or as a context around the forward.
def selective_policy():
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])


MODEL_SETUPS = {
    "checkpointing": lambda m: m.gradient_checkpointing_enable(),
    "every_second_layer": lambda m: m.activation_checkpointing_enable(every_n_layers=2),
    "selective": lambda m: m.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": selective_policy}),
    "offload": lambda m: m.activation_checkpointing_enable(offload=True),
}
CONTEXT_SETUPS = {
    "clone_unpack": lambda: torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x.clone()),
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
}


@pytest.mark.parametrize("setup", [*MODEL_SETUPS, *CONTEXT_SETUPS])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_recomputed_and_moved_activations_match_oracle(family, attn, setup):
    worst = {}
    for seed in SEEDS:
        model = tiny_model(family, attn, seed=seed)
        context = contextlib.nullcontext
        if setup in MODEL_SETUPS:
            MODEL_SETUPS[setup](model)
        else:
            context = CONTEXT_SETUPS[setup]
        plan = chf.trace_plan(model, loss="per_token")
        reference = tiny_model(family, attn, seed=seed)  # the same weights, no checkpointing, no hooks
        ids, keep = batch(seed)
        for attention in ("kept_only", "exact_query"):
            got, stats = filtered(model, plan, ids, keep, attention, context)
            assert stats.tensors_hooked > 0, "the set-up put no saved tensor behind hooks: it tests nothing"
            worst[(seed, attention)] = max_rel_diff(got, oracle(reference, ids, keep, attention))
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{family}/{attn}/{setup}: max relative gradient difference above {TOL}: {bad}"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_with_checkpointing_matches_oracle(family, attn):
    peft = pytest.importorskip("peft")

    def lora_model(seed, checkpointing):
        base = tiny_model(family, attn, seed=seed)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                          lora_dropout=0.0, init_lora_weights=False))
        if checkpointing:
            model.gradient_checkpointing_enable()
        return model

    worst = {}
    for seed in SEEDS:
        model = lora_model(seed, True)
        plan = chf.trace_plan(model, loss="per_token")
        reference = lora_model(seed, False)
        ids, keep = batch(seed)
        for attention in ("kept_only", "exact_query"):
            got, stats = filtered(model, plan, ids, keep, attention)
            assert stats.tensors_hooked > 0 and all("lora" in n for n in got), sorted(got)
            worst[(seed, attention)] = max_rel_diff(got, oracle(reference, ids, keep, attention))
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"LoRA {family}/{attn}: max relative gradient difference above {TOL}: {bad}"


class Block(torch.nn.Module):
    """A pre-norm decoder block written with torch.nn: attention (eager, SDPA, or the oracle) and a GELU MLP."""

    def __init__(self, config, d: int, heads: int):
        super().__init__()
        self.config, self.heads = config, heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x_BTD):
        Bx, Tx, D = x_BTD.shape
        h = self.ln1(x_BTD)
        q, k, v = (p(h).view(Bx, Tx, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))  # [B, H, T, E]
        impl = self.config._attn_implementation
        if impl == ORACLE:
            out = oracle_attention(self, q, k, v, None)[0]  # [B, T, H, E]
        elif impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        else:
            s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
            s = s.masked_fill(torch.ones(Tx, Tx, dtype=torch.bool).triu(1), float("-inf"))
            out = (torch.softmax(s, dim=-1) @ v).transpose(1, 2)
        x_BTD = x_BTD + self.o(out.reshape(Bx, Tx, D))
        return x_BTD + self.fc2(F.gelu(self.fc1(self.ln2(x_BTD))))


class HandWritten(torch.nn.Module):
    """A tiny decoder-only LM with torch.utils.checkpoint(use_reentrant=False) around every block,
    with the two attributes oracle_keep needs (config._attn_implementation, set_attn_implementation)."""

    def __init__(self, attn: str, seed: int, checkpointed: bool, vocab: int = 128, d: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(seed)
        self.config = types.SimpleNamespace(_attn_implementation=attn, vocab_size=vocab)
        self.checkpointed = checkpointed
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(self.config, d, heads) for _ in range(2))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.2)
        self.double()

    def set_attn_implementation(self, name: str):
        self.config._attn_implementation = name

    def forward(self, input_ids, use_cache=False):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return types.SimpleNamespace(logits=self.head(self.ln(h)))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hand_written_model_with_checkpoint_per_block_matches_oracle(attn):
    worst = {}
    for seed in SEEDS:
        model = HandWritten(attn, seed, checkpointed=True)
        plan = collider.trace_plan(random_batch_loss(model))
        reference = HandWritten(attn, seed, checkpointed=False)
        ids, keep = batch(seed)
        for attention in ("kept_only", "exact_query"):
            got, stats = filtered(model, plan, ids, keep, attention)
            assert stats.tensors_hooked > 0
            worst[(seed, attention)] = max_rel_diff(got, oracle(reference, ids, keep, attention))
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"hand-written {attn}: max relative gradient difference above {TOL}: {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_reentrant_checkpointing_is_refused_naming_the_fix(family):
    model = tiny_model(family, "eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(collider.Error) as e:
        chf.trace_plan(model, loss="per_token")
    assert "use_reentrant=False" in str(e.value) and "CheckpointFunctionBackward" in str(e.value), str(e.value)
    # its registration as a passthrough node (what an older message advised) is refused the same way
    with pytest.raises(collider.Error) as e:
        collider.register_passthrough_node("CheckpointFunctionBackward")
    assert "use_reentrant=False" in str(e.value)
    # a plan traced without reentrant checkpointing does not take a reentrant graph, and says why
    plain = tiny_model(family, "eager")
    plan = chf.trace_plan(plain, loss="per_token")
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids, keep = batch(0)
    loss = per_token_loss(plain, ids, keep)
    with pytest.raises(collider.Error) as e:
        collider.filter_backward(loss, keep, plan)
    assert "use_reentrant=False" in str(e.value), str(e.value)
    loss.backward()  # the graph is as it was
