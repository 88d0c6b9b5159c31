"""`python -m exitspec.bench ...` is `exitspec bench ...` (see exitspec/bench/cli.py)."""

import sys

from exitspec.bench.cli import main_bench

sys.exit(main_bench())
