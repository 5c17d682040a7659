"""Percentiles over a time window from two snapshots of a bucketed latency histogram, interpolated
inside the bucket the way Prometheus' histogram_quantile does."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import Histogram


@dataclass(frozen=True)
class HistogramCounts:
    bounds: tuple[float, ...]  # upper bounds of the finite buckets
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds (+Inf)

    @classmethod
    def of(cls, histogram: Histogram) -> HistogramCounts:
        """From an unlabelled prometheus_client Histogram, through its public collect(): its buckets are
        cumulative there, so each count is the difference from the bucket below."""
        cumulative = [
            (float(sample.labels["le"]), sample.value)
            for family in histogram.collect()
            for sample in family.samples
            if sample.name.endswith("_bucket")
        ]
        counts, below = [], 0.0
        for _, count in cumulative:
            counts.append(int(count - below))
            below = count
        return cls(tuple(bound for bound, _ in cumulative if not math.isinf(bound)), tuple(counts))

    @classmethod
    def empty(cls) -> HistogramCounts:
        return cls((), (0,))

    def since(self, older: HistogramCounts) -> HistogramCounts:
        if older.bounds != self.bounds:
            return self
        return HistogramCounts(self.bounds, tuple(a - b for a, b in zip(self.counts, older.counts)))

    @property
    def total(self) -> int:
        return sum(self.counts)


def quantile(q: float, histogram: HistogramCounts) -> float | None:
    """The q-quantile (0..1) of what the histogram counted; None when it counted nothing."""
    total = histogram.total
    if total <= 0:
        return None
    rank = q * total
    cumulative = 0
    for index, count in enumerate(histogram.counts):
        if count > 0 and cumulative + count >= rank:
            if index >= len(histogram.bounds):  # the +Inf bucket: the largest finite bound is all we know
                return histogram.bounds[-1] if histogram.bounds else None
            lower = histogram.bounds[index - 1] if index > 0 else 0.0
            upper = histogram.bounds[index]
            return lower + (upper - lower) * (rank - cumulative) / count
        cumulative += count
    return histogram.bounds[-1] if histogram.bounds else None
