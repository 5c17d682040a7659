"""Percentiles over a time window from two snapshots of a bucketed latency histogram, interpolated
inside the bucket the way Prometheus' histogram_quantile does."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HistogramCounts:
    bounds: tuple[float, ...]  # upper bounds of the finite buckets
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds (+Inf)

    @classmethod
    def of(cls, histogram) -> HistogramCounts:  # noqa: ANN001 - app.observability.prometheus.Histogram
        return cls(tuple(histogram.bounds), tuple(histogram.bucket_counts))

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
