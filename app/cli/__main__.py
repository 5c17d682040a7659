"""`python -m app.cli` runs the `tokenmill` command."""

from app.cli.main import main

raise SystemExit(main())
