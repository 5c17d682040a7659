"""A GGUF's metadata folder made in a child process, on the first start that meets the file.

Making it (engine.loader.prepare_metadata) imports the family's config class and modeling code of transformers
(with torch.distributed.tensor, sympy and triton) and parses the file's vocabulary in pure Python; none of it is
needed again, but a process keeps its imports and most of the freed heap for its life: a 1B Q4_K_M server's
first start settled ~190 MiB above its restarts (2-core EPYC Zen 3). In a child, the server starts from the
kept folder as a restart does. A model it can't run fails the same way, with the child's message.

    python -m engine.gguf_prepare GGUF FOLDER
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.gguf_file import UnsupportedTensorType
from engine.models import UnsupportedModel

# The errors a GGUF's metadata can end in that the server reports in one line (app/cli/serve.py: ValueError,
# OSError); raised again in the parent as the same class with the child's message.
_RELAYED: dict[str, type[Exception]] = {
    error.__name__: error
    for error in (UnsupportedModel, UnsupportedTensorType, ValueError, FileNotFoundError, PermissionError, OSError)
}
_EXIT_REFUSED = 3  # the child's status when it wrote a relayed error as its last line of output


def prepare_in_child(gguf: Path, folder: Path) -> None:
    """engine.loader.prepare_metadata(gguf, folder) in a child Python; its error, if any, raised here."""
    root = str(Path(__file__).resolve().parent.parent)  # engine's own checkout first, as in this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    # its stderr is the server's: transformers' warnings and a crash's traceback show where this start's would
    done = subprocess.run(
        [sys.executable, "-m", "engine.gguf_prepare", str(gguf), str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if done.returncode == 0:
        return
    if done.returncode == _EXIT_REFUSED:
        refused = json.loads(done.stdout.strip().splitlines()[-1])
        raise _RELAYED.get(refused["error"], OSError)(refused["message"])
    raise OSError(f"reading {gguf.name}'s config and tokenizer stopped (exit status {done.returncode}; see above)")


def main(argv: list[str] | None = None) -> int:
    from engine.loader import prepare_metadata

    gguf, folder = (Path(arg) for arg in (argv if argv is not None else sys.argv[1:]))
    try:
        prepare_metadata(gguf, folder)
    except (ValueError, OSError) as error:
        name = next((cls.__name__ for cls in type(error).__mro__ if cls.__name__ in _RELAYED), "OSError")
        print(json.dumps({"error": name, "message": str(error)}), flush=True)
        return _EXIT_REFUSED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
