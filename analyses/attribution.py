"""Moved: ``mxd-lens attribute`` (``mxd-lens attribute --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["attribute", *sys.argv[1:]]))
