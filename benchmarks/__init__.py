"""Runnable benchmarks; each writes JSON (and a PNG where a picture helps)."""
