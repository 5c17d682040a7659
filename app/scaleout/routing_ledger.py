"""What the prefix-aware router has placed: requests in flight per replica (its load), and how many it
routed to each replica by affinity or by load. The router writes it; the ingress's /metrics reads it.

One ledger per process, in `LEDGER`: the router and the ingress run in the same process but maybe on
different threads, hence the lock."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.observability.metrics import OPENMETRICS_ACCEPT, exposition

if TYPE_CHECKING:
    from collections.abc import Callable

# A request whose completion the router never heard of (a lost callback) stops counting after this long,
# so one missed event cannot mark a replica busy for ever. Longer than any generation we serve.
FORGET_AFTER_S = 900.0


class RoutingLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, tuple[str, float]] = {}  # request id -> (replica id, routed at)
        self._routed: Counter[tuple[str, str]] = Counter()  # (replica id, "affinity" | "load") -> requests

    def placed(self, request_id: str, replica_id: str, by: str) -> None:
        """A request goes to `replica_id`. Placing the same request again (Serve asks again when its
        first choice was full) moves it without counting it twice."""
        with self._lock:
            if request_id not in self._in_flight:
                self._routed[(replica_id, by)] += 1
            self._in_flight[request_id] = (replica_id, self.clock())

    def moved(self, request_id: str, replica_id: str) -> None:
        """The request went to `replica_id` after all (its first choice was full)."""
        with self._lock:
            if request_id in self._in_flight:
                self._in_flight[request_id] = (replica_id, self._in_flight[request_id][1])

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._in_flight.pop(request_id, None)

    def loads(self, replica_ids: Iterable[str]) -> dict[str, int]:
        """Requests in flight on each of `replica_ids` (0 for those with none)."""
        loads = dict.fromkeys(replica_ids, 0)
        horizon = self.clock() - FORGET_AFTER_S
        with self._lock:
            for request_id, (replica_id, routed_at) in list(self._in_flight.items()):
                if routed_at < horizon:
                    del self._in_flight[request_id]
                elif replica_id in loads:
                    loads[replica_id] += 1
        return loads

    def routed(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._routed)


def imbalance_ratio(loads: dict[str, int]) -> float:
    """The busiest replica's requests in flight over the mean: 1.0 is even (and idle counts as even)."""
    total = sum(loads.values())
    if not loads or total == 0:
        return 1.0
    return max(loads.values()) / (total / len(loads))


class RoutingCollector(Collector):
    """The router's view for /metrics, per replica: requests routed by affinity and by load, requests in
    flight; and the imbalance ratio (max / mean in flight) over the replicas."""

    def __init__(self, ledger: RoutingLedger, replica_ids: Iterable[str]) -> None:
        self.ledger = ledger
        self.replica_ids = sorted(replica_ids)

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "tokenmill:routed_requests",
            "Requests the prefix-aware router sent to each replica, by why: affinity (it held the prompt's "
            "prefix) or load (no replica under the load bound held enough of it)",
            labels=["replica", "by"],
        )
        counts = self.ledger.routed()
        for replica_id in self.replica_ids:
            for by in ("affinity", "load"):
                routed.add_metric([replica_id, by], counts.get((replica_id, by), 0))
        yield routed
        loads = self.ledger.loads(self.replica_ids)
        in_flight = GaugeMetricFamily(
            "tokenmill:routed_requests_in_flight",
            "Requests routed to each replica that have not finished, as the router counts them (its load)",
            labels=["replica"],
        )
        for replica_id, load in loads.items():
            in_flight.add_metric([replica_id], load)
        yield in_flight
        yield GaugeMetricFamily(
            "tokenmill:routing_imbalance_ratio",
            "Requests in flight on the busiest replica over the mean across replicas (1 = even)",
            value=imbalance_ratio(loads),
        )


def routing_exposition(ledger: RoutingLedger, replica_ids: Iterable[str]) -> str:
    """The router's series in OpenMetrics, to merge with the replicas' (app.observability.metrics.Expositions)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RoutingCollector(ledger, replica_ids))
    return exposition(registry, OPENMETRICS_ACCEPT)[0].decode()  # keeps the names' colons, as the replicas do


LEDGER = RoutingLedger()
