"""Moved: ``mxd-lens spd-induction`` (``mxd-lens spd-induction --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["spd-induction", *sys.argv[1:]]))
