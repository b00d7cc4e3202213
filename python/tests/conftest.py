"""pytest set-up for the collider Python package: imports the collider built by this checkout.

./scripts/test.sh runs `pytest python/tests` after CTest. The package under test is the one in
build/python (the CMake build of this checkout: the _C module and links to python/collider/*.py),
so the tests never pick up another checkout's copy installed in the shared environment; set
COLLIDER_TEST_INSTALLED=1 to test the installed package instead (e.g. after pip install ./python).

Marker `stack`: the modules that drive a whole training stack on the CPU (transformers' Trainer,
TRL, DDP / FSDP2 over gloo, the example script). They check Collider inside those stacks, not the
device code, so the GPU check (scripts/device/run_gpu_checks.sh) runs `-m "not stack and not zoo"`.
Marker `zoo`: test_zoo.py, a tiny model of every causal-LM, masked-LM and image-text-to-text
architecture transformers has (about 325, 2 minutes on one CPU thread); `./scripts/test.sh --quick`
leaves both markers out.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("COLLIDER_BUILD_DIR", ROOT / "build"))
BUILD_PKG = BUILD_DIR / "python"

if os.environ.get("COLLIDER_TEST_INSTALLED") != "1":
    if not (BUILD_PKG / "collider" / "__init__.py").exists():
        raise pytest.UsageError(f"{BUILD_PKG}/collider not found: build first (./scripts/bootstrap.sh)")
    sys.path.insert(0, str(BUILD_PKG))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tests' helpers (oracle.py, tiny_models.py)

# Tiny models: one intra-op thread is fastest and keeps the two cores for ctest-like parallel runs.
torch.set_num_threads(int(os.environ.get("COLLIDER_TEST_THREADS", "1")))


STACK_MODULES = {"test_example.py", "test_fsdp2.py", "test_hf_trainer.py", "test_normalisation.py",
                 "test_peft_ddp.py", "test_trainers_checkpointing.py", "test_trl.py"}
ZOO_MODULES = {"test_zoo.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "stack: drives a whole training stack on the CPU (see the module's docstring)")
    config.addinivalue_line("markers", "zoo: every transformers causal-LM and masked-LM architecture (test_zoo.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in STACK_MODULES:
            item.add_marker(pytest.mark.stack)
        if item.path.name in ZOO_MODULES:
            item.add_marker(pytest.mark.zoo)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def build_dir() -> Path:
    """This checkout's CMake build (COLLIDER_BUILD_DIR, default build/): where its C++ programs are."""
    return BUILD_DIR
