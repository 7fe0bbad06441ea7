"""Moved: ``mxd-lens probe-merge`` (``mxd-lens probe-merge --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["probe-merge", *sys.argv[1:]]))
