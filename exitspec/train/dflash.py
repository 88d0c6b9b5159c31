"""`python -m exitspec.train.dflash ...` and `torchrun ... -m exitspec.train.dflash ...`: see exitspec.train.cli."""

import sys

from exitspec.train.cli import main_dflash

if __name__ == "__main__":
    sys.exit(main_dflash())
