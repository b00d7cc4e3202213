"""Builds the collider Python package: the extensions collider._C (the mechanism and its API) and
collider._measure (the measuring kit the benchmarks use) are the CMake targets `collider_python` and
`collider_measure_python` of python/CMakeLists.txt, compiled against the torch of the running Python.

  pip install --no-build-isolation ./python      # from the Collider checkout; builds collider_core too
Environment:
  COLLIDER_PREBUILT_EXT=PATH  copy this already-built _C module, and the _measure module beside it,
                              instead of compiling (what scripts/bootstrap.sh does with the ones its
                              CMake build made)
  COLLIDER_JOBS=N             build parallelism (default: number of cores)
  COLLIDER_CUDA=ON            also compile collider_core's CUDA sources (needs nvcc)
Needs CMake >= 3.22, a C++17 compiler with OpenMP (g++) and the Python headers (python3-dev).
"""
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def check_build_requirements() -> None:
    """What `pip install --no-build-isolation` needs in the environment besides torch (it installs
    no build requirement itself): a setuptools that builds wheels (>= 70.1; older ones need the
    separate `wheel` package, without which pip stops at "invalid command 'bdist_wheel'")."""
    import setuptools
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) >= (70, 1):
        return
    try:
        import wheel  # noqa: F401
    except ImportError:
        sys.exit(f"collider setup.py: setuptools {setuptools.__version__} cannot build a wheel without the "
                 "`wheel` package; run `python -m pip install 'setuptools>=70.1'` in this environment, then the "
                 "install again")


check_build_requirements()


def copy_build_record(module_dir: Path, package_dir: Path) -> None:
    """_torch_build.py, which the CMake build writes beside _C: the torch it was compiled against,
    what the package's import guard compares with the torch it is imported under."""
    record = module_dir / "_torch_build.py"
    if not record.is_file():
        sys.exit(f"collider setup.py: {record} is missing: rebuild the module with this checkout's CMake "
                 "(python/CMakeLists.txt writes it beside _C)")
    shutil.copyfile(record, package_dir / "_torch_build.py")


class CMakeExtension(Extension):
    def __init__(self, name: str, target: str):
        super().__init__(name, sources=[])
        self.target = target  # the CMake target that builds it


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        stem = ext.name.rsplit(".", 1)[1]  # _C, or a module built beside it
        prebuilt = os.environ.get("COLLIDER_PREBUILT_EXT")
        if prebuilt:
            src = Path(prebuilt)
            if not src.is_file():
                sys.exit(f"collider setup.py: COLLIDER_PREBUILT_EXT={prebuilt} is not a file")
            if stem != src.name.split(".")[0]:
                src = src.parent / (stem + suffix)
                if not src.is_file():
                    sys.exit(f"collider setup.py: {src} is missing beside COLLIDER_PREBUILT_EXT={prebuilt}: "
                             "build it with the same CMake build (its target is " + ext.target + ")")
            if not src.name.endswith(suffix):
                sys.exit(f"collider setup.py: {src.name} was built for another Python (expected suffix {suffix})")
            shutil.copyfile(src, target)
            copy_build_record(src.parent, target.parent)
            print(f"collider setup.py: copied prebuilt {src} -> {target}")
            return
        if not (HERE.parent / "collider_core" / "CMakeLists.txt").is_file():
            sys.exit("collider setup.py: ../collider_core not found; build from a Collider checkout "
                     "(pip install --no-build-isolation ./python in its root)")
        try:
            import torch.utils
        except ImportError:
            sys.exit("collider setup.py: torch is not importable; install torch first and use "
                     "pip install --no-build-isolation so that the extension is built against it")
        # One CMake tree per installed torch (its release and where it lies): a tree configured for
        # another torch, or for the same release in another environment (since removed), would keep
        # linking that one.
        torch_dir = str(Path(torch.__file__).resolve().parent)
        build_dir = (Path(self.build_temp).resolve() /
                     f"cmake-torch{torch.__version__}-{hashlib.sha1(torch_dir.encode()).hexdigest()[:10]}")
        out_dir = build_dir / "module"
        cmake = shutil.which("cmake")
        if not cmake:
            sys.exit("collider setup.py: cmake (>= 3.22) not found on PATH (apt-get install cmake, or pip install cmake)")
        args = [cmake, "-S", str(HERE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython3_EXECUTABLE={sys.executable}",
                f"-DCOLLIDER_PYTHON_OUTPUT_DIR={out_dir}",
                f"-DCOLLIDER_CUDA={os.environ.get('COLLIDER_CUDA', 'OFF')}", "-Wno-dev"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        if shutil.which("ccache"):
            args += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        subprocess.run(args, check=True)
        jobs = os.environ.get("COLLIDER_JOBS", str(os.cpu_count() or 1))
        subprocess.run([cmake, "--build", str(build_dir), "--target", ext.target, "-j", jobs], check=True)
        built = [p for p in out_dir.iterdir() if p.name == stem + suffix]
        if len(built) != 1:
            sys.exit(f"collider setup.py: expected {stem}{suffix} in {out_dir}, found {[p.name for p in out_dir.iterdir()]}")
        shutil.copyfile(built[0], target)
        copy_build_record(out_dir, target.parent)


setup(ext_modules=[CMakeExtension("collider._C", "collider_python"),
                   CMakeExtension("collider._measure", "collider_measure_python")],
      cmdclass={"build_ext": CMakeBuild})
