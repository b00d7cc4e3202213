"""Collider under FSDP2 (torch.distributed.fsdp.fully_shard on every decoder layer and the root),
gloo, 2 ranks on loopback, tiny random Llama (sdpa), and Mixtral (a mixture of experts; sdpa,
float64).

Each rank takes its half of a batch, normalises its loss by the kept tokens of both halves (times
the world size: FSDP2 averages the gradients over ranks), filters and runs the backward; the
sharded gradients, gathered, must equal the oracle's (oracle.py) on the whole batch in one process,
with the same weights. Three steps with an SGD update between them; the plan is traced before
training and traced again after the first step: forwards without a backward (the traces) would
leave FSDP2's state half-done and the next step wrong, so collider.trace_plan gives each traced
loss of a sharded model a backward of zero (python/collider/__init__.py). FSDP2's node
(RegisterPostBackwardFunctionBackward) passes through (collider.hf registers it).
  float64, both semantics: max relative difference <= 1e-4 at every step;
  MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), weights at transformers'
  initialisation scale (0.02): within 2e-2 of the float32 oracle.
  pytest python/tests/test_fsdp2.py
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, model_oracle, tiny_model
from test_peft_ddp import free_port

T, ROWS, STEPS = 37, 2, 3


def batch(step: int, world: int):
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 128, (ROWS * world, T), generator=gen)
    keep = collider.select_tokens(torch.rand(ROWS * world, T, generator=gen), 0.4, policy="batch_topk",
                                  valid=chf.keep_mask_from_labels(ids))
    return ids, keep


def worker(rank, world, port, out_dir, sys_path, mixed, family):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        kw = dict(dtype=torch.float32, initializer_range=0.02) if mixed else {}
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        result = {}
        for attention in ("kept_only", "exact_query"):
            model = tiny_model(family, "sdpa", **kw)
            reference = tiny_model(family, "sdpa", **kw)  # the whole model in one process: the oracle
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, **({"mp_policy": policy} if mixed else {}))
            fully_shard(model, mesh=mesh, **({"mp_policy": policy} if mixed else {}))
            plan = chf.trace_plan(model, loss="per_token")
            worst = []
            for step in range(STEPS):
                if step == 1:
                    plan = chf.trace_plan(model, loss="per_token")  # again, during training
                ids, keep = batch(step, world)
                model.zero_grad(set_to_none=True)
                logits = model(input_ids=ids[mine], use_cache=False).logits
                loss = chf.masked_mean(chf.token_losses(logits, ids[mine]), keep[mine], keep.sum()) * world
                collider.filter_backward(loss, keep[mine], plan, attention=attention)
                loss.backward()
                got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                weights = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
                with torch.no_grad():
                    for n, p in reference.named_parameters():
                        p.copy_(weights[n])
                reference.zero_grad(set_to_none=True)
                with model_oracle(reference, keep, attention):
                    chf.masked_mean(chf.token_losses(reference(input_ids=ids, use_cache=False).logits, ids),
                                    keep).backward()
                worst.append(max_rel_diff(got, grads(reference)))
                with torch.no_grad():  # SGD on the shards
                    for p in model.parameters():
                        p -= 0.05 * p.grad
            result[attention] = worst
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family, mixed", [("llama", False), ("llama", True), ("mixtral", False)],
                         ids=["float64", "bf16_mixed_precision", "mixtral_float64"])
def test_fsdp2_steps_equal_one_process_oracle(tmp_path, family, mixed):
    world = 2
    mp.spawn(worker, args=(world, free_port(), str(tmp_path), list(sys.path), mixed, family), nprocs=world,
             join=True)
    bound = 2e-2 if mixed else 1e-4
    for r in range(world):
        result = torch.load(tmp_path / f"rank{r}.pt")
        for attention, worst in result.items():
            assert len(worst) == STEPS and all(w <= bound for w in worst), (r, attention, worst)
