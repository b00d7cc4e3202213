#!/usr/bin/env python3
"""Generates the Hugging Face reference fixtures in tests/fixtures/hf/<family>/.

For each family (llama, qwen2, phi) it builds a tiny random model with Hugging Face `transformers`
(LlamaForCausalLM; Qwen2ForCausalLM with tied embeddings; PhiForCausalLM with partial rotary 0.5),
saves it with save_pretrained (config.json + model.safetensors; qwen2 in shards with
model.safetensors.index.json), and writes the fixed input and what
transformers computes for it:
  expected.safetensors: input_ids [B, T] I64, logits [B, T, V] F32, losses [B, T-1] F32 (nats;
                        losses[b, t] = loss of predicting input_ids[b, t+1] from tokens 0..t)
  tokens.txt:           the same input_ids, one sequence per line (input of `collider score`)
  expected_scores.jsonl:{"seq": i, "losses": [...]} as `collider score` must print it
The fixtures are committed; transformers is NOT needed by the build or the tests. Regenerate with
  ~/.cache/collider/venv/bin/pip install transformers
  ~/.cache/collider/venv/bin/python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]
tests/test_hf_agreement.cpp checks that our models reproduce the logits (max abs diff <= 1e-4, fp32).
"""
import argparse
import json
import os
import shutil

import torch
import transformers
from safetensors.torch import save_file

B, T = 2, 16  # batch, sequence


def configs():
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 16
        max_position_embeddings=64,
        initializer_range=0.02,
        attn_implementation="eager",
        torch_dtype=torch.float32,
    )
    llama = transformers.LlamaConfig(
        intermediate_size=96, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **common)
    qwen2 = transformers.Qwen2Config(
        intermediate_size=80, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, use_sliding_window=False, **common)
    phi = transformers.PhiConfig(
        intermediate_size=128, num_key_value_heads=4, layer_norm_eps=1e-5, rope_theta=10000.0,
        partial_rotary_factor=0.5, hidden_act="gelu_new", tie_word_embeddings=False,
        qk_layernorm=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **common)
    return {
        "llama": (transformers.LlamaForCausalLM, llama),
        "qwen2": (transformers.Qwen2ForCausalLM, qwen2),
        "phi": (transformers.PhiForCausalLM, phi),
    }


def perturb_(model, gen):
    # HF initialises norm weights to 1 and biases to 0, which would hide a missing or misnamed
    # norm/bias mapping; give every parameter a distinct random value instead.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                # 0.08 keeps the logits O(1) so that the 1e-4 check is not trivially met.
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf"))
    args = ap.parse_args()
    torch.manual_seed(0)
    for i, (family, (cls, cfg)) in enumerate(configs().items()):
        gen = torch.Generator().manual_seed(1234 + i)
        model = cls(cfg).eval().to(torch.float32)
        perturb_(model, gen)
        input_ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, dtype=torch.int64)
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits.float()  # [B, T, V]
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, cfg.vocab_size), input_ids[:, 1:].reshape(-1),
            reduction="none").view(B, T - 1)
        out = os.path.join(args.out, family)
        if os.path.isdir(out):
            shutil.rmtree(out)
        # qwen2 is written in shards (model.safetensors.index.json + model-0000k-of-0000n.safetensors)
        # so that the sharded layout is covered by a file transformers itself wrote.
        shard = {"max_shard_size": "100KB"} if family == "qwen2" else {}
        model.save_pretrained(out, **shard)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))
        save_file({"input_ids": input_ids.contiguous(), "logits": logits.contiguous(),
                   "losses": losses.contiguous()},
                  os.path.join(out, "expected.safetensors"),
                  metadata={"transformers_version": transformers.__version__,
                            "torch_version": torch.__version__, "family": family})
        with open(os.path.join(out, "tokens.txt"), "w") as f:
            for row in input_ids.tolist():
                f.write(" ".join(str(t) for t in row) + "\n")
        with open(os.path.join(out, "expected_scores.jsonl"), "w") as f:
            for b in range(B):
                f.write(json.dumps({"seq": b, "losses": [float(x) for x in losses[b].tolist()]}) + "\n")
        size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
        print(f"{family}: {cls.__name__} params={sum(p.numel() for p in model.parameters())} "
              f"logits std={logits.std():.3f} mean loss={losses.mean():.3f} files={sorted(os.listdir(out))} "
              f"bytes={size}")


if __name__ == "__main__":
    main()
