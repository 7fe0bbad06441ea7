"""Moved: ``mxd-lens spd-ablation`` (``mxd-lens spd-ablation --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["spd-ablation", *sys.argv[1:]]))
