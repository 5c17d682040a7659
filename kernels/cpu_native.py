"""Native CPU kernels (kernels/csrc), compiled on first use with the machine's C++ compiler.

Each source is built once per source text, flags and CPU into a cache folder, then loaded with ctypes:
no torch headers, so a build takes about a second. Where no compiler works (a slim image), `library()`
returns None and the torch paths run instead; the reason is logged once. TOKENMILL_NATIVE_KERNELS=0
turns them off.
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
COMMON_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
FLAGS = {
    "paged_decode_cpu": [*COMMON_FLAGS, "-ffp-contract=fast", "-mprefer-vector-width=512"],
    # Bit-equal rounding with the torch references needs every product rounded before the add.
    "elementwise_cpu": [*COMMON_FLAGS, "-ffp-contract=off"],
}
DISABLE_ENV = "TOKENMILL_NATIVE_KERNELS"

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}


def cache_folder() -> Path:
    configured = os.environ.get("TOKENMILL_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "kernels"


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def _cpu_signature() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build(compiler: str, source: Path, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp{os.getpid()}")
    command = [compiler, *flags, str(source), "-o", str(staging)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        staging.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    staging.rename(target)  # atomic: concurrent processes never load a half-written library


def _load(name: str) -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler found: the CPU kernels use the slower torch paths")
        return None
    source, flags = CSRC / f"{name}.cpp", FLAGS[name]
    texts = [path.read_bytes() for path in (source, *sorted(CSRC.glob("*.h")))]  # the headers it may include
    tag = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode(), compiler.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = cache_folder() / f"{name}-{tag}.so"
    try:
        if not target.exists():
            _build(compiler, source, flags, target)
        return ctypes.CDLL(str(target))  # CDLL releases the GIL during calls
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("native CPU kernel %s unavailable, using the torch path: %s", name, error)
        return None


def library(name: str) -> ctypes.CDLL | None:
    """The loaded native library `name` (a source in kernels/csrc), or None where it can't be built."""
    if name in _libraries:
        return _libraries[name]
    with _lock:
        if name not in _libraries:
            _libraries[name] = _load(name) if enabled() else None
        return _libraries[name]
