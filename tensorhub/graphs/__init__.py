"""Ray Compiled Graph pipelines (see issue: compiled graphs)."""
