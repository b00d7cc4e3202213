"""The import guard: collider records the torch it was compiled against (collider/_torch_build.py,
written by the build) and refuses, with an ImportError that names both releases and the reinstall
command, to load under another torch. The cross-release import itself (a package built for one
torch imported in an environment with another) is run by scripts/compat_matrix.sh; here the
package is copied with its record altered, which reaches the same comparison."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import collider


def test_mismatch_names_both_releases_and_the_reinstall():
    why = collider.torch_mismatch("2.11.0", True, "2.15.0+cu132", True)
    assert "built against torch 2.11.0" in why and "torch 2.15.0 is imported" in why
    assert "pip install --no-build-isolation ./python" in why
    why = collider.torch_mismatch("2.15.0", True, "2.15.0", False)
    assert "_GLIBCXX_USE_CXX11_ABI=1" in why and "uses 0" in why
    # the local tag (+cu130, +cpu) is not part of the release
    assert collider.torch_mismatch("2.15.0", True, "2.15.0+cpu", True) is None


def test_record_matches_the_running_torch():
    from collider import _torch_build
    assert _torch_build.TORCH_VERSION == torch.__version__.split("+")[0] == collider._C.TORCH_VERSION_BUILT
    assert _torch_build.CXX11_ABI == bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def _import_copy(tmp_path: Path, record: str = None) -> subprocess.CompletedProcess:
    pkg = tmp_path / "collider"
    shutil.copytree(Path(collider.__file__).absolute().parent, pkg, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if record is not None:
        (pkg / "_torch_build.py").write_text(record)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, "-c", "import collider"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)


def test_package_built_for_another_torch_is_refused(tmp_path):
    r = _import_copy(tmp_path, f'TORCH_VERSION = "2.99.0"\nCXX11_ABI = {bool(torch._C._GLIBCXX_USE_CXX11_ABI)}\n')
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: collider was built against torch 2.99.0"), r.stderr
    assert f"torch {torch.__version__.split('+')[0]} is imported" in last and "--no-build-isolation" in last


def test_package_without_its_record_is_refused(tmp_path):
    pkg_copy = _import_copy(tmp_path)
    assert pkg_copy.returncode == 0, pkg_copy.stderr  # the unaltered copy imports
    (tmp_path / "collider" / "_torch_build.py").unlink()
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import collider"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "build record (collider/_torch_build.py) is missing" in r.stderr
