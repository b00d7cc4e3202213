"""python/bench/bench_hf_backward.py against the C++ owners: its table of shapes (a Python copy of
models/llama.cpp's presets) and its FLOP counts (the C++ FLOP model through the bindings, on the shape
it builds from a transformers config) equal what `collider models --json` (harness/recipes/cli.cpp)
prints: each preset's shapes and, at T = 512 and 2048 with 40% filtered, the kept count, forward and
backward FLOPs per token (dense, kept_only, exact_query) and the attention/linear ratio. And its
rounds are the C++ engine's (measuring/rounds.h): warm-ups in order, then serpentine rounds; its
provenance the C++ rows' record; its --json rows keyed as the C++ sweeps' rows.
Skipped without the C++ CLI (build/collider, from the C++ build).
  pytest python/tests/test_bench_hf_backward.py
"""
import importlib.util
import json
import subprocess
import sys

import pytest

import collider
import collider._measure  # the measuring kit (allocator, provenance, rounds, figures, FLOP model)


@pytest.fixture(scope="module")
def bench(repo_root):
    path = repo_root / "python" / "bench" / "bench_hf_backward.py"
    spec = importlib.util.spec_from_file_location("bench_hf_backward", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def presets(build_dir):
    cli = build_dir / "collider"
    if not cli.is_file():
        pytest.skip(f"{cli} not found: the C++ CLI comes with the C++ build (./scripts/bootstrap.sh); "
                    "set COLLIDER_BUILD_DIR to a build that has it")
    out = subprocess.run([str(cli), "models", "--json"], capture_output=True, text=True, check=True, timeout=60)
    return {p["name"]: p for p in json.loads(out.stdout)}


PRESETS = ["tinyllama-mini", "tinyllama-1.1b", "tinyllama-debug"]


@pytest.mark.parametrize("shapes", PRESETS)
def test_shapes_are_the_cli_presets(bench, presets, shapes):
    dims, p = bench.SHAPES[shapes], presets[shapes]
    names = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
             "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "vocab_size": "vocab_size"}
    assert dims == {ours: p[theirs] for ours, theirs in names.items()}
    assert (dims["hidden_size"] // dims["num_attention_heads"], p["family"], p["tie_embeddings"]) == \
        (p["head_dim"], "llama", False)


@pytest.mark.parametrize("shapes", PRESETS)
def test_flops_per_token_are_the_cli_counts(bench, presets, shapes):
    dims = bench.SHAPES[shapes]
    for f in presets[shapes]["flops"]:
        T, N = f["seq_len"], f["kept"]
        assert collider.kept_count(T, f["filter_ratio"]) == N
        fwd = bench.forward_flops(dims, 1, T)
        assert sum(fwd.values()) / T == pytest.approx(f["fwd_flops_per_token"], rel=1e-12)
        assert fwd["attention"] / fwd["linear"] == pytest.approx(f["attention_linear_ratio"], rel=1e-12)
        for mode in ("dense", "kept_only", "exact_query"):
            assert bench.backward_flops(dims, 1, T, N, mode) / T == pytest.approx(
                f[f"bwd_flops_per_token_{mode}"], rel=1e-12), f"{shapes} T={T} {mode}"


def test_rounds_run_in_serpentine_order(bench):
    calls = []
    samples = bench.side_by_side(lambda m: calls.append(m) or len(calls), ("a", "b", "c"), warmup=1, reps=2)
    assert calls == ["a", "b", "c", "a", "b", "c", "c", "b", "a"]
    assert samples == {"a": [4, 9], "b": [5, 8], "c": [6, 7]}


def test_medians_and_spread_are_the_engines(bench):
    assert bench.median_iqr([4.0, 1.0, 3.0, 2.0]) == pytest.approx((2.5, 1.5))  # q25 1.75, q75 3.25
    assert bench.per_round_median([9.0, 5.0, 8.0], [10.0, 10.0, 10.0]) == pytest.approx(0.2)


def test_provenance_is_the_rows_record(bench, repo_root):
    import subprocess as sp
    import torch
    prov = bench.provenance("caching", torch.device("cpu"), False)
    # The keys every C++ row carries (harness/run/results.cpp: to_json), collected by the same code.
    rows_keys = {"git_sha", "git_dirty", "torch_version", "cuda_version", "device_name", "num_threads", "hostname"}
    assert rows_keys <= prov.keys()
    head = sp.run(["git", "-C", str(repo_root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head:
        assert prov["git_sha"] == head
    assert prov["num_threads"] == torch.get_num_threads()
    assert torch.__version__.startswith(prov["torch_version"])


def test_rows_are_result_rows(bench, tmp_path):
    """--json writes one row per method keyed as the C++ sweeps' rows (DESIGN.md section 6), with the
    point's keys and the method's figures beside them."""
    import json
    out = tmp_path / "rows.jsonl"
    argv = ["bench_hf_backward.py", "--shapes", "tinyllama-debug", "--seq", "32", "--attn", "eager", "--reps", "1",
            "--warmup", "0", "--allocator", "system", "--json", str(out)]  # torch's allocator stays
    old, sys.argv = sys.argv, argv
    try:
        assert bench.main() == 0
    finally:
        sys.argv = old
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == list(bench.METHODS)
    identity = {"experiment", "point_id", "status", "error", "model", "seq_len", "batch_size", "filter_ratio",
                "method", "attention_grad", "dtype", "device", "git_sha", "torch_version", "device_name",
                "bwd_ms", "bwd_ms_rel_iqr", "fwd_ms", "peak_mem_bytes", "flop_ideal_bwd_reduction", "floor_of"}
    for r in rows:
        assert identity <= r.keys(), identity - r.keys()
    by = {r["label"]: r for r in rows}
    assert (by["collider exact_query"]["method"], by["collider exact_query"]["attention_grad"]) == ("collider", "exact_query")
    assert by["collider kept_only"]["flop_ideal_bwd_reduction"] == by["collider kept_only"]["ideal"] > 0
    floor = by["floor"]
    assert (floor["method"], floor["floor_of"], floor["seq_len"]) == ("regular", 32, floor["kept"] + 1)
    assert len({r["point_id"] for r in rows}) == len(rows)


def test_group_figures_are_the_engines(bench):
    """Its reduction, share of the FLOP ideal and ratio to the floor come from the engine's own
    computation (collider._measure.group_figures, measuring/figures.h), which the C++ rows are written
    with: regular 100 ms, collider 70 ms with ideal 0.4, loss_only 99 ms, the floor 56 ms."""
    methods = {"regular": {"bwd_ms": 100.0}, "collider kept_only": {"bwd_ms": 70.0, "ideal": 0.4},
               "loss_only": {"bwd_ms": 99.0}, "floor": {"bwd_ms": 56.0}}
    bench.group_figures(methods)
    assert methods["regular"]["reduction"] == 0.0
    assert methods["collider kept_only"]["reduction"] == pytest.approx(0.30)
    assert methods["collider kept_only"]["of_ideal"] == pytest.approx(0.75)
    assert methods["collider kept_only"]["vs_floor"] == pytest.approx(1.25)
    assert methods["loss_only"]["of_ideal"] is None
    assert methods["floor"]["vs_floor"] is None and methods["floor"]["reduction"] == pytest.approx(0.44)
    with pytest.raises(ValueError, match="allowed: baseline, copy, floor, method"):
        collider._measure.group_figures([{"role": "reference", "cost_ms": 1.0}])
