"""`python -m exitspec ...` is `exitspec ...`."""

import sys

from exitspec.cli import main

sys.exit(main())
