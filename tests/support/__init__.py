"""What the tests share beside fixtures: paths, fake engines and gateways, servers in threads, and the
air-gap tooling. Fixtures are in tests/conftest.py (and tests/support/gateway.py, a plugin it loads)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Converted weights are cached here across sessions (CI converts the GGUF once per run).
MODEL_CACHE = Path(os.environ.get("TOKENMILL_TEST_DATA_DIR", ROOT / ".tokenmill"))
