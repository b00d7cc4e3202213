"""RHO-1 token selection with Collider's filtered backward in Hugging Face transformers' Trainer,
on a tiny Llama config and the project's prepared text (scripts/prepare_data.sh).

Two stages, as in RHO-1: a reference model is trained on the curated split (curated_train.bin),
then the model is trained on the noisy mixture (mix_train.bin) keeping, in every sequence, the
tokens whose loss exceeds the reference model's the most; the dropped tokens' activations are cut
from the whole backward by collider.filter_backward (inside collider.hf.Rho1Trainer).
  ./scripts/prepare_data.sh                 # once: ~/.cache/collider/data (--sample for a small one)
  python examples/train_rho1_llama.py --steps 20
  python examples/train_rho1_llama.py --data /tmp/sample --steps 3 --reference-steps 3   # a few seconds
Tested by python/tests/test_example.py (a few steps on the --sample data).
"""
from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import collider
import collider.hf

SHARD_MAGIC = b"CLDRTOK1"  # header of harness/components/token_data.h: magic, u32 version, u32 bytes per token,
SHARD_HEADER = "<8sIIQII"  # u64 number of tokens, u32 vocab size, u32 eos id (32 bytes, little endian)


def read_shard(path: str):
    """Token ids of one shard (memory-mapped) and its vocabulary size."""
    with open(path, "rb") as f:
        magic, version, token_bytes, num_tokens, vocab, _eos = struct.unpack(SHARD_HEADER, f.read(32))
    if magic != SHARD_MAGIC or version != 1 or token_bytes not in (2, 4):
        sys.exit(f"{path}: not a Collider token shard (magic {magic!r}, version {version}); "
                 "write one with scripts/prepare_data.sh")
    dtype = np.uint16 if token_bytes == 2 else np.uint32
    ids = np.memmap(path, dtype=dtype, mode="r", offset=32, shape=(num_tokens,))
    return ids, vocab


class Windows(Dataset):
    """Non-overlapping windows of seq_len tokens; labels = input_ids (the model shifts them)."""

    def __init__(self, ids: np.ndarray, seq_len: int):
        n = len(ids) // seq_len
        if n == 0:
            sys.exit(f"the shard has {len(ids)} tokens, fewer than one window of {seq_len}")
        self.ids = torch.from_numpy(np.asarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintSteps(TrainerCallback):
    def __init__(self, name, trainer_ref=None):
        self.name, self.trainer_ref = name, trainer_ref

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            extra = ""
            trainer = self.trainer_ref[0] if self.trainer_ref else None
            stats = getattr(trainer, "last_filter_stats", None)
            if stats is not None:
                extra = (f"  kept {stats.kept}/{stats.seq_len} per row, rewrite {stats.rewrite_ms:.1f} ms, "
                         f"{stats.tensors_gathered} tensors cut")
            print(f"[{self.name}] step {state.global_step}: loss {logs['loss']:.4f}{extra}", flush=True)


def tiny_llama(vocab: int, seq_len: int, args, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=seq_len,
                      attention_dropout=0.0, use_cache=False, attn_implementation=args.attn)
    return LlamaForCausalLM(cfg)


def eval_loss(model, ds: Windows, batches: int, batch_size: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            ids = ds.ids[i * batch_size:(i + 1) * batch_size]
            total += model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    model.train()
    return total / batches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.environ.get("COLLIDER_DATA", os.path.expanduser("~/.cache/collider/data")))
    ap.add_argument("--steps", type=int, default=20, help="RHO-1 training steps")
    ap.add_argument("--reference-steps", type=int, default=20, help="reference model steps on the curated split")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--filter-ratio", type=float, default=0.4, help="fraction of each sequence's tokens dropped")
    ap.add_argument("--method", choices=collider.hf.METHODS, default="collider")
    ap.add_argument("--attention", choices=("kept_only", "exact_query"), default="kept_only")
    ap.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="transformers attn_implementation")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="Trainer output directory (default: a temporary one)")
    args = ap.parse_args()
    print(f"[example] {vars(args)}", flush=True)

    shards = {s: os.path.join(args.data, f"{s}.bin") for s in ("curated_train", "mix_train", "curated_eval")}
    missing = [p for p in shards.values() if not os.path.exists(p)]
    if missing:
        print(f"[example] missing {missing}: run ./scripts/prepare_data.sh (or --sample --out DIR and --data DIR)",
              file=sys.stderr)
        return 2
    data = {s: read_shard(p) for s, p in shards.items()}
    vocab = data["curated_train"][1]
    sets = {s: Windows(ids, args.seq_len) for s, (ids, _) in data.items()}
    out = args.out or tempfile.mkdtemp(prefix="collider-rho1-")

    def training_args(name, steps):
        return TrainingArguments(output_dir=os.path.join(out, name), max_steps=steps, per_device_train_batch_size=args.batch,
                                 learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                                 save_strategy="no", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                                 dataloader_num_workers=0, seed=args.seed)

    t0 = time.time()
    reference = tiny_llama(vocab, args.seq_len, args, seed=args.seed)
    Trainer(model=reference, args=training_args("reference", args.reference_steps), train_dataset=sets["curated_train"],
            callbacks=[PrintSteps("reference")]).train()

    model = tiny_llama(vocab, args.seq_len, args, seed=args.seed + 1)
    holder = []
    trainer = collider.hf.Rho1Trainer(
        model=model, args=training_args("rho1", args.steps), train_dataset=sets["mix_train"], reference_model=reference,
        filter_ratio=args.filter_ratio, method=args.method, attention=args.attention, loss="labels",
        callbacks=[PrintSteps(f"rho1/{args.method}", holder)])
    holder.append(trainer)
    trainer.train()

    n_eval = max(1, min(4, len(sets["curated_eval"]) // args.batch))
    ref_loss = eval_loss(reference, sets["curated_eval"], n_eval, args.batch)
    model_loss = eval_loss(model, sets["curated_eval"], n_eval, args.batch)
    if trainer.collider_plan is not None:
        print(f"[example] plan: {trainer.collider_plan.summary()}")
    print(f"[example] curated_eval loss: reference {ref_loss:.4f}, rho1/{args.method} {model_loss:.4f} "
          f"(vocab {vocab}, {time.time() - t0:.1f} s)")
    return 0 if math.isfinite(model_loss) else 1


if __name__ == "__main__":
    sys.exit(main())
