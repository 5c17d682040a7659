"""The `tokenmill` command: main.py parses and dispatches; one module per subcommand group (serve, ray,
admin: teams / keys / usage, models)."""
