"""Moved: ``mxd-lens spd-induction-model`` (``mxd-lens spd-induction-model --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["spd-induction-model", *sys.argv[1:]]))
