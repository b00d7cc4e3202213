"""examples/train_rho1_llama.py runs end to end: scripts/prepare_data.sh --sample writes real token
shards (needs network or the cached .deb files, like the C++ utility tests), then the example
trains its reference model and the RHO-1 model with Collider for a few steps of a tiny Llama.
  pytest python/tests/test_example.py
"""
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("data")
    env = dict(os.environ, COLLIDER_PYTHON=sys.executable)
    r = subprocess.run([str(repo_root / "scripts" / "prepare_data.sh"), "--out", str(out), "--sample"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"prepare_data.sh --sample failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return out


@pytest.mark.parametrize("method, attention", [("collider", "kept_only")])
def test_example_trains_a_few_steps(sample_data, repo_root, method, attention):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, str(repo_root / "examples" / "train_rho1_llama.py"), "--data", str(sample_data),
                        "--steps", "3", "--reference-steps", "2", "--seq-len", "64", "--batch", "2",
                        "--method", method, "--attention", attention], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"example failed:\n{r.stdout}\n{r.stderr}"
    lines = r.stdout.splitlines()
    steps = [l for l in lines if l.startswith(f"[rho1/{method}] step")]
    assert len(steps) == 3, r.stdout
    # 64 positions, the last has no label: 63 labelled, 40% dropped (25.2 -> 32 with align 8) -> 31 kept
    assert all("kept 31/64 per row" in l for l in steps), r.stdout
    assert any(l.startswith("[example] curated_eval loss") for l in lines), r.stdout
