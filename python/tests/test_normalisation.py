"""One token normalisation across gradient accumulation and ranks: the filtered loss of a micro-batch
is the sum of its kept tokens' losses over the kept tokens of the whole optimizer step
(collider.hf.masked_mean with num_kept = collider.hf.step_kept_count), so the gradients summed over
micro-batches and averaged over ranks equal one process's on the whole batch.

4 micro-batches x 2 ranks (PyTorch DDP, gloo on loopback, no_sync for the first three), RHO-1's
batch_topk selection per micro-batch (ragged rows), one micro-batch whose rows keep nothing (its
loss is zero; it takes a plain backward, since there is nothing to filter), tiny random Llama
(float64, sdpa), both semantics, against one process with Collider on the 4 x 2 micro-batches'
rows at once (max relative difference <= 1e-4). The step's kept count is known from the labels
before any forward (collider.kept_total), checked against the masks select_tokens returns.
  pytest python/tests/test_normalisation.py
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collider
import collider.hf as chf
from oracle import grads, max_rel_diff, tiny_model
from test_peft_ddp import free_port

T, ROWS, MICRO, WORLD, RATIO = 37, 2, 4, 2, 0.6
EMPTY = (1, 2)  # (rank, micro-batch) whose rows keep nothing


def micro_batch(rank: int, micro: int):
    """Rows, their labels' valid mask, and the keep mask RHO-1's batch_topk gives (random scores)."""
    gen = torch.Generator().manual_seed(1000 * rank + micro)
    ids = torch.randint(0, 128, (ROWS, T), generator=gen)
    labels = ids.clone()
    if (rank, micro) == EMPTY:
        labels[:] = -100  # nothing to predict (say, a micro-batch of padding)
    else:
        labels[1, T - 5 * (micro + 1):] = -100  # rows of different lengths
    valid = chf.keep_mask_from_labels(labels)
    if not bool(valid.any()):
        return ids, labels, valid, torch.zeros_like(valid)
    scores = torch.rand(ROWS, T, generator=gen)
    keep = collider.select_tokens(scores, RATIO, policy="batch_topk", valid=valid)
    return ids, labels, valid, keep


def step_loss(model, ids, labels, keep, num_kept, scale=1.0):
    return chf.masked_mean(chf.token_losses(model(input_ids=ids, use_cache=False).logits, labels), keep,
                           num_kept) * scale


def worker(rank, world, port, out_dir, sys_path):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(tiny_model("llama", "sdpa"))
        plan = chf.trace_plan(model, loss="per_token")
        batches = [micro_batch(rank, k) for k in range(MICRO)]
        num_kept = chf.step_kept_count([b[2] for b in batches], RATIO, policy="batch_topk")  # all-reduced
        result = {"num_kept": int(num_kept)}
        for attention in ("kept_only", "exact_query"):
            model.zero_grad(set_to_none=True)
            for k, (ids, labels, valid, keep) in enumerate(batches):
                sync = k == MICRO - 1
                ctx = model.no_sync() if not sync else torch.enable_grad()
                with ctx:
                    loss = step_loss(model, ids, labels, keep, num_kept, scale=world)  # DDP averages over ranks
                    if bool(keep.any()):
                        collider.filter_backward(loss, keep, plan, attention=attention)
                    loss.backward()
            result[attention] = grads(model.module)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_accumulation_and_ranks_equal_one_big_batch(tmp_path):
    mp.spawn(worker, args=(WORLD, free_port(), str(tmp_path), list(sys.path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    parts = [micro_batch(r, k) for r in range(WORLD) for k in range(MICRO)]
    ids, labels, keep = (torch.cat([p[i] for p in parts]) for i in (0, 1, 3))
    assert int(keep[2 * (EMPTY[0] * MICRO + EMPTY[1]):][:ROWS].sum()) == 0, "the empty micro-batch keeps nothing"
    counts = keep.sum(1)
    assert len(set(counts.tolist())) > 2, f"rows should keep different counts: {counts.tolist()}"
    # the step's count, known from the labels alone, is what the selections kept
    for r in range(WORLD):
        assert ranks[r]["num_kept"] == int(keep.sum())
    model = tiny_model("llama", "sdpa")
    plan = chf.trace_plan(model, loss="per_token")
    for attention in ("kept_only", "exact_query"):
        model.zero_grad(set_to_none=True)
        loss = step_loss(model, ids, labels, keep, None)
        collider.filter_backward(loss, keep, plan, attention=attention)
        loss.backward()
        single = grads(model)
        for r in range(WORLD):
            assert max_rel_diff(ranks[r][attention], single) <= 1e-4, (attention, r)


def test_kept_total_is_what_select_tokens_keeps():
    gen = torch.Generator().manual_seed(3)
    valid = torch.rand(4, 29, generator=gen) > 0.2
    for policy, align in (("batch_topk", 1), ("per_sequence", 1), ("per_sequence", 8)):
        v = valid if policy == "batch_topk" else torch.ones_like(valid)
        for ratio in (0.0, 0.25, 0.4, 0.6):
            keep = collider.select_tokens(torch.rand(4, 29, generator=gen), ratio, policy=policy, align=align, valid=v)
            assert collider.kept_total(v, ratio, policy, align) == int(keep.sum()), (policy, align, ratio)
    assert collider.kept_total(torch.zeros(2, 5, dtype=torch.bool), 0.4, "batch_topk") == 0
