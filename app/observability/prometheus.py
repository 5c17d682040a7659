"""Prometheus text exposition (format 0.0.4): just enough to write counters, gauges and histograms."""
from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

Labels = Mapping[str, str]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def sample(name: str, labels: Labels, value: float) -> str:
    return f"{name}{_labels(labels)} {_number(value)}"


def gauge(name: str, help_text: str, labels: Labels, value: float) -> list[str]:
    return [*header(name, "gauge", help_text), sample(name, labels, value)]


def counter(name: str, help_text: str, labelled_values: Iterable[tuple[Labels, float]]) -> list[str]:
    return [*header(name, "counter", help_text), *(sample(name, labels, value) for labels, value in labelled_values)]


class Histogram:
    """Cumulative buckets. Observed from the event loop only, so no lock."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = sorted(buckets)
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.bucket_counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def render(self, labels: Labels) -> list[str]:
        lines = header(self.name, "histogram", self.help_text)
        cumulative = 0
        for bound, bucket_count in zip([*self.bounds, math.inf], self.bucket_counts):
            cumulative += bucket_count
            lines.append(sample(f"{self.name}_bucket", {**labels, "le": _number(bound)}, cumulative))
        lines.append(sample(f"{self.name}_count", labels, self.count))
        lines.append(sample(f"{self.name}_sum", labels, self.sum))
        return lines
