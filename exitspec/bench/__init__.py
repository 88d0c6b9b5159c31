"""Benchmarks: `python -m exitspec.bench` (= `exitspec bench`) runs the suite; `python -m exitspec.bench.verifier`
times the verifier decision alone."""
