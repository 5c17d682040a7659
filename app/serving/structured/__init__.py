"""Structured output: `response_format` and `tools` enforced by constrained decoding (see plan.py)."""
