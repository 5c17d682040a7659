"""Shared by the air-gap tests: one offline bundle per test session, scripts run in a network namespace with
no network, and the audit of every connection attempt that strace saw."""
from __future__ import annotations

import atexit
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "airgap_client.py"
# Survives between CI runs on one machine (the Debian base image); a clean machine builds it from nothing.
CACHE_DIR = Path(os.environ.get("TOKENMILL_CI_CACHE", "/var/cache/tokenmill-ci"))
# Every attempt to reach an address: connect() for TCP and connected UDP, sendto/sendmsg for unconnected UDP;
# bind() too, which shows that strace did see the server's own socket.
STRACE = ("strace", "-f", "--seccomp-bpf", "-qq", "-e", "signal=none", "-e", "trace=connect,bind,sendto,sendmsg")
LOCAL_FAMILIES = {"AF_UNIX", "AF_NETLINK", "AF_UNSPEC"}  # AF_UNSPEC: a UDP socket being disconnected


def require_tools(*tools: str) -> None:
    """Network namespaces and chroot need root; .ci/run installs the tools, so in CI a gap is a failure."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    problem = "needs root" if os.geteuid() != 0 else f"missing {', '.join(missing)}" if missing else None
    if problem:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"air-gap test {problem} (bash .ci/run sets it up)")


def run(command: list[str | Path], *, timeout: float, what: str, **options) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], check=False, capture_output=True, text=True,
                            timeout=timeout, **options)
    if result.returncode != 0:
        raise AssertionError(f"{what} failed ({result.returncode}):\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return result


def scratch_dir(prefix: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)
    return folder


@functools.cache
def built_bundle() -> Path:
    """deploy/bundle.py's CPU bundle, built once per test session (pip's cache keeps later builds fast)."""
    out = scratch_dir("tokenmill-bundle-") / "tokenmill-bundle-cpu"
    run([sys.executable, ROOT / "deploy" / "bundle.py", "--out", out], timeout=900, what="bundle build")
    return out


def run_without_network(script: str, workdir: Path, *, timeout: float, what: str) -> subprocess.CompletedProcess:
    """A bash script in new network and mount namespaces: no interface but loopback, which it brings up."""
    path = workdir / f"{what.replace(' ', '-')}.sh"
    path.write_text("set -euo pipefail\nip link set lo up\n" + script)
    return run(["unshare", "--net", "--mount", "--fork", "--kill-child", "bash", path], timeout=timeout, what=what)


def traced(name: str, workdir: Path) -> str:
    """Shell words that run a command under strace, its log in workdir/trace-NAME.log."""
    return shlex.join([*STRACE, "-o", str(workdir / f"trace-{name}.log")])


def client_command(url: str) -> str:
    """Shell words for the openai client; $key and $server_pid come from the script."""
    return f'{shlex.join([sys.executable, str(CLIENT), url])} "$key" "$server_pid"'


def outbound_attempts(trace_lines: list[str]) -> list[str]:
    """Lines of an strace log that address anything but loopback, a unix socket or the kernel."""
    flagged = []
    for line in trace_lines:
        family = re.search(r"sa_family=(AF_\w+)", line)
        if family is None or re.match(r"\d+\s+bind\(", line) or family[1] in LOCAL_FAMILIES:
            continue
        if family[1] == "AF_INET":
            address = re.search(r'inet_addr\("([^"]+)"\)', line)
            if address and address[1].startswith("127."):
                continue
        elif family[1] == "AF_INET6":
            address = re.search(r'inet_pton\(AF_INET6, "([^"]+)"', line)
            if address and (address[1] == "::1" or address[1].startswith("::ffff:127.")):
                continue
        flagged.append(line.strip())
    return flagged


def audit(workdir: Path) -> tuple[int, list[str]]:
    """(connection attempts seen, those outside loopback) over every trace log in workdir."""
    lines = [line for path in sorted(workdir.glob("trace-*.log")) for line in path.read_text().splitlines()]
    attempts = [line for line in lines if "sa_family=" in line and not re.match(r"\d+\s+bind\(", line)]
    return len(attempts), outbound_attempts(lines)
