"""One request, from its body to the engine and back: body -> prompt -> sampling -> engine -> JSON or SSE;
tracker.py follows it to its end (metrics, usage, release)."""
