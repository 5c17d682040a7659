"""The Docker image builds from the offline bundle with no network, and serves with none.

buildah (there is no Docker engine here) builds the repository's Dockerfile in a network namespace with no
network, FROM a Debian bookworm base made here with debootstrap (no registry is reachable; --build-arg
BASE_IMAGE points at it). Then the image's root filesystem is mounted and, chrooted into it as the image's
user, with its environment, working directory, entrypoint and command and a data volume bound where the
image declares one, tokenmill serves the openai client over loopback in a namespace with no network, under
the same strace audit as the bundle test, and the image's own HEALTHCHECK passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from kernels import cpu_native
from tests.support.airgap import (
    CACHE_DIR,
    ROOT,
    STOP_SERVER,
    assert_nothing_reached_out,
    built_bundle,
    require_tools,
    run,
    run_without_network,
    scratch_dir,
    serve_then_ask,
)

pytestmark = pytest.mark.airgap

BASE_PACKAGES = ("python3", "python3-venv", "passwd")  # bookworm's python3 is 3.11, as the bundle's wheels
BASE_KEY = hashlib.sha256(" ".join(("bookworm", "minbase", *BASE_PACKAGES)).encode()).hexdigest()[:10]
BASE_IMAGE = f"localhost/tokenmill-ci-base:bookworm-{BASE_KEY}"
NATIVE_KERNELS_CHECK = (
    "import shutil\n"
    "from kernels import cpu_native\n"
    "print('compiler' if shutil.which('g++') or shutil.which('c++') else 'no-compiler',"
    " *[name for name in cpu_native.FLAGS if cpu_native.library(name) is not None])\n"
)


def debian_mirror() -> str | None:
    """The bookworm mirror apt uses on this machine (debootstrap's default when none is found)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.MULTILINE))
            if "bookworm" in fields.get("Suites", "").split() and fields.get("URIs"):
                return fields["URIs"].split()[0]
    sources = Path("/etc/apt/sources.list")
    for line in sources.read_text().splitlines() if sources.exists() else []:
        match = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", line)
        if match:
            return match[1]
    return None


def base_rootfs_tarball() -> Path:
    """Debian bookworm minbase with Python 3.11, kept in the CI cache (debootstrap takes about a minute)."""
    tarball = CACHE_DIR / f"debian-bookworm-{BASE_KEY}.tar"
    if tarball.exists():
        return tarball
    rootfs = scratch_dir("tokenmill-debootstrap-") / "rootfs"
    mirror = [mirror] if (mirror := debian_mirror()) else []
    run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", rootfs, *mirror],
        timeout=900,
        what="debootstrap",
    )
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial")
    run(["tar", "-C", rootfs, "-cf", partial, "."], timeout=300, what="base tarball")
    partial.rename(tarball)
    return tarball


def base_image() -> str:
    """The base imported into buildah's store once (FROM scratch + ADD), then reused."""
    try:
        run(["buildah", "inspect", "--type", "image", BASE_IMAGE], timeout=60, what="base image lookup")
        return BASE_IMAGE
    except AssertionError:
        pass
    context = scratch_dir("tokenmill-base-")
    os.link(base_rootfs_tarball(), context / "rootfs.tar")
    (context / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n')
    run(
        [
            "unshare",
            "--net",
            "buildah",
            "bud",
            "--isolation",
            "chroot",
            "--quiet",
            "--tag",
            BASE_IMAGE,
            "--file",
            context / "Containerfile",
            context,
        ],
        timeout=600,
        what="base image import",
    )
    return BASE_IMAGE


def image_user(rootfs: Path, user: str) -> tuple[int, int, str]:
    """(uid, gid, home) of the image's USER, read from its own /etc/passwd."""
    for line in (rootfs / "etc" / "passwd").read_text().splitlines():
        name, _, uid, gid, _, home, _ = line.split(":")
        if user in (name, uid):
            return int(uid), int(gid), home
    raise AssertionError(f"USER {user} is not in the image's /etc/passwd")


@pytest.fixture
def built_image():
    """The repository's Dockerfile built from the session's bundle, in a namespace with no network."""
    require_tools("unshare", "ip", "strace", "buildah", "debootstrap", "chroot")
    base = base_image()
    context = scratch_dir("tokenmill-context-")
    shutil.copytree(built_bundle(), context / "dist" / "tokenmill-bundle-cpu", copy_function=os.link)
    shutil.copy(ROOT / ".dockerignore", context)
    tag = f"localhost/tokenmill-ci:airgap-{os.getpid()}"
    try:
        run(
            [
                "unshare",
                "--net",
                "buildah",
                "bud",
                "--isolation",
                "chroot",
                "--format",
                "docker",
                "--pull=never",
                "--build-arg",
                f"BASE_IMAGE={base}",
                "--tag",
                tag,
                "--file",
                ROOT / "Dockerfile",
                context,
            ],
            timeout=1200,
            what="image build",
        )
        yield tag
    finally:
        run(["buildah", "rmi", "--force", tag], timeout=300, what="image removal")


def test_image_builds_offline_and_serves_chat_with_no_network(built_image):
    config = json.loads(
        run(["buildah", "inspect", "--type", "image", built_image], timeout=60, what="image inspect").stdout
    )["Docker"]["config"]
    assert "8000/tcp" in config["ExposedPorts"]
    assert config["Healthcheck"]["Test"][0] == "CMD-SHELL" and "/health" in config["Healthcheck"]["Test"][1]
    assert {"TOKENMILL_HOST=0.0.0.0", "TOKENMILL_PORT=8000", "HF_HUB_OFFLINE=1"} <= set(config["Env"])
    [volume] = config["Volumes"]
    container = run(["buildah", "from", "--pull=never", built_image], timeout=300, what="container").stdout.strip()
    try:
        rootfs = Path(run(["buildah", "mount", container], timeout=120, what="mount").stdout.strip())
        uid, gid, home = image_user(rootfs, config["User"])
        assert uid != 0, "the image must not run as root"
        work = scratch_dir("tokenmill-image-run-")
        (work / "volume").mkdir()
        os.chown(work / "volume", uid, gid)
        environment = shlex.join([*config["Env"], f"HOME={home}"])
        in_image = (
            f"env -i {environment} {shutil.which('chroot')} --userspec={uid}:{gid} {rootfs} "
            f"/usr/bin/env -C {config['WorkingDir'] or '/'}"
        )
        entrypoint = shlex.join(config["Entrypoint"] or [])
        entrypoint_and_command = shlex.join([*(config["Entrypoint"] or []), *(config["Cmd"] or [])])
        script = f"""
mount -t proc proc {rootfs}/proc
mount --rbind /dev {rootfs}/dev
mount --rbind /sys {rootfs}/sys
mount --bind {work}/volume {rootfs}{volume}
{in_image} python -c {shlex.quote(NATIVE_KERNELS_CHECK)} > {work}/native_kernels
{in_image} {entrypoint} teams create airgap >/dev/null
key=$({in_image} {entrypoint} keys create --team airgap 2>/dev/null | grep '^sk-')
{serve_then_ask(f"{in_image} {entrypoint_and_command}", work)}
{in_image} /bin/sh -c {shlex.quote(config["Healthcheck"]["Test"][1])}
echo passed > {work}/healthcheck
{STOP_SERVER}"""
        run_without_network(script, work, timeout=900, what="image serve")
    finally:
        run(["buildah", "umount", container], timeout=120, what="unmount")
        run(["buildah", "rm", container], timeout=120, what="container removal")
    result = json.loads((work / "result.json").read_text())
    assert "Paris" in result["chat"]
    assert result["admin_login_status"] == 200
    assert result["embedding_dimensions"] == [384, 384]
    assert (work / "healthcheck").read_text().strip() == "passed"
    assert any(path.name.startswith("models") for path in (work / "volume").iterdir())  # data went to the volume
    # The slim image has no compiler; every CPU kernel the bundle prebuilt loads instead of the torch paths.
    assert (work / "native_kernels").read_text().split() == ["no-compiler", *cpu_native.FLAGS]
    assert_nothing_reached_out(work)


def test_compose_runs_the_image_against_its_postgres_with_data_in_the_image_volume():
    import yaml

    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    tokenmill, postgres = compose["services"]["tokenmill"], compose["services"]["postgres"]
    assert (ROOT / "deploy" / tokenmill["build"]["context"] / "Dockerfile").exists()
    assert tokenmill["depends_on"]["postgres"]["condition"] == "service_healthy" and "healthcheck" in postgres
    url = tokenmill["environment"]["TOKENMILL_DATABASE_URL"]
    assert url.startswith("postgresql+psycopg://") and "@postgres:5432/" in url
    volume = re.search(r'^VOLUME \["([^"]+)"\]', (ROOT / "Dockerfile").read_text(), re.MULTILINE)[1]
    assert any(mount.endswith(f":{volume}") for mount in tokenmill["volumes"])
    assert any(port.endswith(":8000") for port in tokenmill["ports"])
