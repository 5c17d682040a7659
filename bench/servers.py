"""The servers a bench or a test starts as child processes: a free port, `tokenmill serve`'s command line,
the `tokenmill` CLI, waiting for /health, and stopping one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(port: int, data_dir: str | Path, *options: str) -> list[str]:
    """`tokenmill serve` in a child Python (run it with cwd=ROOT) on 127.0.0.1:`port`, its converted weights
    cached under `data_dir`, logging warnings only; `options` come last, so they win."""
    return [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--log-level",
        "warning",
        *options,
    ]


def tokenmill_cli(*argv: str) -> str:
    """What `tokenmill ARGV...` prints (a failure raises)."""
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *argv], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


def wait_healthy(url: str, process: subprocess.Popen | None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not come up")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
