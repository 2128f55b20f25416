"""The worker-side engine: scheduling core (core/), model math (model/), checkpoint loading (loading/)."""
