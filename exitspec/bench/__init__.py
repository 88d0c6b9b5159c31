"""Benchmarks: `exitspec bench` runs the suite (runner, rows, report, presets); `exitspec latency` times the
verifier decision alone (latency.py). `python -m exitspec.bench` is `exitspec bench`."""
