"""The model registry: what models this server may run (a SQL table), which of them are loaded now (a
pool of engines), and the admin API, CLI and dashboard views over both."""
