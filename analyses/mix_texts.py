"""Moved: ``mxd-lens mix`` (``mxd-lens mix --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["mix", *sys.argv[1:]]))
