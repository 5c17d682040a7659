"""Run tokenmill as Ray Serve replicas behind one HTTP ingress, from a checkout: the same as
`tokenmill serve --ray` (app/cli/ray.py; how it works: app/scaleout/ray_serve.py).

    python deploy/ray_serve.py --replicas 2 --database-url postgresql+psycopg://... --redis-url redis://...
    python deploy/ray_serve.py --min-replicas 1 --max-replicas 4 --ray-address auto
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from app.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "--ray", *sys.argv[1:]]))
