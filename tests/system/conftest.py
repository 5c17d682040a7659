"""System suites: the whole server under attack, faults, fuzzing, no network, Ray, Kubernetes manifests and the
benchmarks' smoke runs. Each test is marked `system` and by its suite, named by its file
(test_<suite>_*.py), so `-m "not system"` runs the unit and integration tests alone and `-m security`
one suite."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SUITES = {"security", "reliability", "fuzz", "airgap", "ray", "k8s", "bench"}  # test_<suite>_*.py


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent != HERE:
            continue
        suite = item.path.stem.split("_")[1]
        assert suite in SUITES, f"{item.path.name}: a system test file is named test_<suite>_*.py, suite in {SUITES}"
        item.add_marker("system")
        item.add_marker(suite)
