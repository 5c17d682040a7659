"""Native CPU kernels (kernels/csrc), compiled on first use with the machine's C++ compiler.

Each source is built once per source text, flags and CPU into a cache folder, then loaded with ctypes:
no torch headers, so a build takes about a second. Where no compiler works (the slim Docker image),
libraries built ahead for portable x86-64 levels (`prebuild`, run by deploy/bundle.py into the wheel's
kernels/prebuilt/) are loaded instead, the best level this CPU supports; failing both, `library()`
returns None and the torch paths run. The choice is logged once. TOKENMILL_NATIVE_KERNELS=0 turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

log = logging.getLogger("tokenmill.kernels")

CSRC = Path(__file__).parent / "csrc"
# -march=native: the library is built on the machine that runs it, and the loops need its vector units.
# -fno-trapping-math: nothing here reads the floating-point exception flags, and without it GCC keeps a loop
# with a float compare in a select (fast_exp's clamp, a weight cut) scalar on AVX2, which has no mask
# registers to vectorize it otherwise (SiLU, the softmax of decode attention, 2-core EPYC Zen 3). It allows
# vector selects, not reassociation; loops marked `omp simd reduction` then sum in lanes on AVX2 as on AVX-512.
COMMON_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
]
FLAGS = {
    "paged_decode_cpu": [*COMMON_FLAGS, "-ffp-contract=fast", "-mprefer-vector-width=512"],
    # Bit-equal rounding with the torch references needs every product rounded before the add.
    "elementwise_cpu": [*COMMON_FLAGS, "-ffp-contract=off"],
    "qlinear_cpu": [*COMMON_FLAGS, "-ffp-contract=fast", "-mprefer-vector-width=512"],
    "sample_cpu": [*COMMON_FLAGS, "-ffp-contract=fast", "-mprefer-vector-width=512"],
    "lora_cpu": [*COMMON_FLAGS, "-ffp-contract=fast", "-mprefer-vector-width=512"],
    "decode_stack_cpu": COMMON_FLAGS,  # calls the kernels above, through pointers: no arithmetic of its own
}
DISABLE_ENV = "TOKENMILL_NATIVE_KERNELS"
PREBUILT_ENV = "TOKENMILL_PREBUILT_KERNELS"
# Portable builds, best first, with the /proc/cpuinfo flags each level needs (the psABI's x86-64-v3/v4).
PORTABLE_TARGETS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"),
    "x86-64-v3": ("avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"),
}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}


def cache_folder() -> Path:
    configured = os.environ.get("TOKENMILL_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "kernels"


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def prebuilt_folder() -> Path:
    return Path(os.environ.get(PREBUILT_ENV) or Path(__file__).parent / "prebuilt")


def _cpu_signature() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _source_texts(name: str) -> list[bytes]:
    return [path.read_bytes() for path in (CSRC / f"{name}.cpp", *sorted(CSRC.glob("*.h")))]  # and what it includes


def portable_flags(name: str, target: str) -> list[str]:
    return [flag if flag != "-march=native" else f"-march={target}" for flag in FLAGS[name]]


def prebuilt_name(name: str, target: str) -> str:
    """File name of a portable build; it changes with the sources, so a stale library is never loaded."""
    tag = hashlib.sha256(b"\0".join([*_source_texts(name), " ".join(portable_flags(name, target)).encode()]))
    return f"{name}-{target}-{tag.hexdigest()[:16]}.so"


def supported_targets(cpu_flags: str | None = None) -> list[str]:
    """The portable levels this CPU runs, best first (none off x86-64)."""
    flags = set((cpu_flags if cpu_flags is not None else _cpu_signature()).split())
    return [target for target, needs in PORTABLE_TARGETS.items() if flags.issuperset(needs)]


def prebuild(
    destination: Path, compiler: str | None = None, targets: tuple[str, ...] = tuple(PORTABLE_TARGETS)
) -> list[Path]:
    """Builds every kernel for every portable level into `destination` (deploy/bundle.py, for images
    without a compiler). Returns the libraries written."""
    compiler = compiler or _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler: install g++ to prebuild the CPU kernels")
    written = []
    for name in FLAGS:
        for target in targets:
            library_path = destination / prebuilt_name(name, target)
            _build(compiler, CSRC / f"{name}.cpp", portable_flags(name, target), library_path)
            written.append(library_path)
    return written


def _build(compiler: str, source: Path, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    command = [compiler, *flags, str(source), "-o", str(staging)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        staging.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    staging.rename(target)  # atomic: concurrent processes never load a half-written library


def _load_built_here(name: str) -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    source, flags = CSRC / f"{name}.cpp", FLAGS[name]
    tag = hashlib.sha256(
        b"\0".join([*_source_texts(name), " ".join(flags).encode(), compiler.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = cache_folder() / f"{name}-{tag}.so"
    if not target.exists():
        _build(compiler, source, flags, target)
    return ctypes.CDLL(str(target))  # CDLL releases the GIL during calls


def _load_prebuilt(name: str) -> tuple[ctypes.CDLL, str] | None:
    for target in supported_targets():
        path = prebuilt_folder() / prebuilt_name(name, target)
        if path.exists():
            return ctypes.CDLL(str(path)), target
    return None


def _load(name: str) -> ctypes.CDLL | None:
    try:
        return _load_built_here(name)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        reason = str(error)
    try:
        prebuilt = _load_prebuilt(name)
    except OSError as error:
        prebuilt, reason = None, f"{reason}; prebuilt: {error}"
    if prebuilt is not None:
        log.info(
            "native CPU kernel %s: prebuilt for %s (not built here: %s)", name, prebuilt[1], reason.splitlines()[0]
        )
        return prebuilt[0]
    log.warning("native CPU kernel %s unavailable, using the slower torch path: %s", name, reason)
    return None


def library(name: str) -> ctypes.CDLL | None:
    """The loaded native library `name` (kernels/csrc), built here or prebuilt; None where neither works."""
    if name in _libraries:
        return _libraries[name]
    with _lock:
        if name not in _libraries:
            _libraries[name] = _load(name) if enabled() else None
        return _libraries[name]
