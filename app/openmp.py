"""How idle OpenMP workers wait, set before torch loads (imported first by app.cli.main and the Ray replicas).

A one-stream decode step is ~150 parallel regions a few microseconds apart, run from the engine's own
thread. Two things decide whether a worker is awake for the next one:
- GOMP_SPINCOUNT: rounds an idle worker spins before it sleeps. libgomp's default (300k rounds, ~ms) would let
  idle workers starve the event loop between steps on small machines; waking a sleeping worker for each
  region (OMP_WAIT_POLICY=PASSIVE) cost 3 of 10 ms per token at one stream. 10k rounds bridge the gaps inside
  a step, not the time between steps.
- libgomp counts every thread it manages (the main thread's pool and the engine thread's) and, once they
  outnumber the CPUs, as on a 2-core machine, spins only GOMP_SPINCOUNT's "throttled" 100 rounds, which is
  under a microsecond on AMD Zen (its pause instruction is short): the worker slept between regions, and one
  stream ran 11 ms a token where the same step run from the main thread took 4 (one streamed chat on a
  2-core EPYC: 75 -> ~210 tok/s). OMP_WAIT_POLICY=ACTIVE raises the throttled spin to 1000 rounds, and
  GOMP_SPINCOUNT still bounds the ordinary spin, so workers do go to sleep between steps.
An operator's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins over both defaults.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}


def default_openmp_waiting(environ: MutableMapping[str, str] = os.environ) -> None:
    if not any(name in environ for name in OPENMP_DEFAULTS):
        environ.update(OPENMP_DEFAULTS)


default_openmp_waiting()
