"""The gateway: teams, API keys, limits, budgets and usage metering in front of /v1."""
