"""Reproducible benchmarks of kvstore against its peers (`python -m benchmarks.engine`)."""
