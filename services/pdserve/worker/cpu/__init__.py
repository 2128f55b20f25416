"""The worker on a CPU: the cores it shares with the machine's other workers, and its C heap."""
