"""`pdserve serve`: its settings, the launcher and the supervisor of the router and worker processes."""
