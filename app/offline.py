"""tokenmill never reaches out: the hub libraries are told they are offline before any of them is imported.

Imported first by app.cli.main. huggingface_hub, transformers and datasets read these variables once, at
import, so setting them later has no effect. They are forced, not defaulted: an air-gapped install must
not be talked back online by a variable left in the environment.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OFFLINE_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    "DISABLE_TELEMETRY": "1",  # older transformers
    "DO_NOT_TRACK": "1",
}


def go_offline(environ: MutableMapping[str, str] = os.environ) -> None:
    environ.update(OFFLINE_ENVIRONMENT)


go_offline()
