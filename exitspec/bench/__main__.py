"""`python -m exitspec.bench ...` is `exitspec bench ...`."""

import sys

from exitspec.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
