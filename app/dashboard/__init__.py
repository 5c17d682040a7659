"""The admin dashboard at /admin: live occupancy, KV use and cost per token; teams, keys, models,
usage and a playground. Pages in web/templates, our own CSS and JS in web/static."""
