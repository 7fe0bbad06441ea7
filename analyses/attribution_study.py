"""Moved: ``mxd-lens attribution`` (``mxd-lens attribution --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

sys.exit(main(["attribution", *sys.argv[1:]]))
