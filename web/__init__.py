"""Templates and static files of the admin dashboard (a package so that installs carry them)."""
