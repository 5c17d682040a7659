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

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "support" / "airgap_client.py"
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
    result = subprocess.run(
        [str(part) for part in command], check=False, capture_output=True, text=True, timeout=timeout, **options
    )
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


def serve_then_ask(serve: str, workdir: Path) -> str:
    """Bash that starts `serve` (shell words) under strace and has the openai client (tests/support/airgap_client.py)
    ask it on port 8000 with $key; the answers land in workdir/result.json. STOP_SERVER ends it."""
    client = shlex.join([sys.executable, str(CLIENT), "http://127.0.0.1:8000"])
    return f"""
{traced("serve", workdir)} bash -c 'echo $$ > {workdir}/server.pid; exec "$@"' serve {serve} > {workdir}/serve.log 2>&1 &
tracer=$!
for _ in $(seq 300); do [ -s {workdir}/server.pid ] && break; sleep 0.1; done
server_pid=$(cat {workdir}/server.pid)
trap 'kill "$server_pid" 2>/dev/null || true' EXIT
{client} "$key" "$server_pid" > {workdir}/result.json || {{ tail -n 40 {workdir}/serve.log >&2; exit 1; }}
"""


STOP_SERVER = 'kill -INT "$server_pid"\nwait "$tracer" || true\n'


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


def assert_nothing_reached_out(workdir: Path) -> None:
    """Over every trace log in workdir: no attempt off loopback, and strace did see the server bind its port."""
    lines = [line for path in sorted(workdir.glob("trace-*.log")) for line in path.read_text().splitlines()]
    attempts = [line for line in lines if "sa_family=" in line and not re.match(r"\d+\s+bind\(", line)]
    outbound = outbound_attempts(lines)
    assert outbound == [], f"connection attempts off this machine ({len(attempts)} in all):\n" + "\n".join(outbound)
    assert any(
        " bind(" in line and "htons(8000)" in line for line in (workdir / "trace-serve.log").read_text().splitlines()
    ), "strace did not see the server"
