"""Shoal's benchmarks: ``python -m bench`` runs them all and writes results.json and RESULTS.md."""
