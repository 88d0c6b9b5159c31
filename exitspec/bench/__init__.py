"""Benchmarks, each runnable as `python -m exitspec.bench.<name>` (see its module docstring)."""
