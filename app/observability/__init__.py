"""What the server measures: Prometheus metrics, their exposition, and the hardware cost per token."""
