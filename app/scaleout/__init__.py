"""More than one replica: Ray Serve deployment, the ASGI forwarding into a replica, prefix-aware routing."""
