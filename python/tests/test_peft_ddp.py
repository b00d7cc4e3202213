"""Collider under the wrappers researchers train with: a PEFT LoRA model (lora_dropout > 0) against
its oracle, and PyTorch DistributedDataParallel (gloo, 2 ranks on loopback) against one process on
the concatenated batch.

LoRA: the dropout masks must be the same in the Collider run and the oracle run, so the RNG is
reseeded before each forward; a different seed must change the gradient (dropout is really on).
DDP (Llama, and Mixtral's routed experts): DDP's reducer hooks fire on each parameter's
AccumulateGrad node, which filter_backward leaves in place, so the all-reduce sees Collider's
gradients. Each rank's loss is the mean over its own
kept tokens and DDP averages over ranks; per_sequence selection gives every rank the same kept
count, so the average is the mean over every kept token: one process on the 2B-row batch.
  pytest python/tests/test_peft_ddp.py
"""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, oracle_keep, tiny_model

T = 37


def lora_model(attn):
    from peft import LoraConfig, get_peft_model
    base = tiny_model("llama", attn)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, bias="none",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg)
    torch.manual_seed(2)  # LoRA B starts at zero: give it values so every LoRA weight gets a gradient
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    model.train()
    return model


def masked_loss(model, ids, keep):
    return chf.training_loss(model, ids, ids, keep, loss="per_token")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_lora_with_dropout_matches_oracle(attn):
    model = lora_model(attn)
    plan = chf.trace_plan(model, loss="per_token")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (3, T), generator=gen)
    keep = collider.select_tokens(torch.rand(3, T, generator=gen), 0.5, valid=chf.keep_mask_from_labels(ids))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(10)
        loss = masked_loss(model, ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        got = grads(model)
        assert sorted(got) == sorted(trainable)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(10)  # the same dropout masks
        with oracle_keep(model, keep, attention):
            masked_loss(model, ids, keep).backward()
        ref = grads(model)
        assert max_rel_diff(got, ref) <= 1e-4, attention
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # other dropout masks: another gradient
        with oracle_keep(model, keep, attention):
            masked_loss(model, ids, keep).backward()
        assert max_rel_diff(grads(model), ref) > 1e-3


# ---- DistributedDataParallel -------------------------------------------------------------------

def batch(rows):
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 128, (rows, T), generator=gen)
    keep = collider.select_tokens(torch.rand(rows, T, generator=gen), 0.5, valid=chf.keep_mask_from_labels(ids))
    return ids, keep


def ddp_worker(rank, world, port, rows_per_rank, out_dir, sys_path, family):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(tiny_model(family, "sdpa"))
        plan = chf.trace_plan(model, loss="per_token")  # through the DDP wrapper
        ids, keep = batch(world * rows_per_rank)
        mine = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        result = {}
        for attention in ("kept_only", "exact_query"):
            model.zero_grad(set_to_none=True)
            loss = masked_loss(model, ids[mine], keep[mine])
            collider.filter_backward(loss, keep[mine], plan, attention=attention)
            loss.backward()  # DDP all-reduces in its hooks during this backward
            result[attention] = grads(model.module)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_ddp_two_ranks_equal_one_process(tmp_path, family):
    world, rows = 2, 2
    mp.spawn(ddp_worker, args=(world, free_port(), rows, str(tmp_path), list(sys.path), family), nprocs=world,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    model = tiny_model(family, "sdpa")
    plan = chf.trace_plan(model, loss="per_token")
    ids, keep = batch(world * rows)
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = masked_loss(model, ids, keep)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        single = grads(model)
        for r in range(world):
            assert max_rel_diff(ranks[r][attention], single) <= 1e-10, (attention, r)
        # and not what rank 0's own rows give without the all-reduce (it really happened)
        model.zero_grad(set_to_none=True)
        loss = masked_loss(model, ids[:rows], keep[:rows])
        collider.filter_backward(loss, keep[:rows], plan, attention=attention)
        loss.backward()
        assert max_rel_diff(ranks[0][attention], grads(model)) > 1e-3
