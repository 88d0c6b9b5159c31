"""`python -m exitspec.train.dflash ...` (also under torchrun) is `exitspec train dflash ...`."""

import sys

from exitspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", "dflash", *sys.argv[1:]]))
