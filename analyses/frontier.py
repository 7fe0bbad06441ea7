"""Moved: ``mxd-lens frontier`` (``mxd-lens frontier --help``). This shim goes in the next release."""

import sys

from mxd_lens.cli import main

args = sys.argv[1:]
if "--report" in args:  # now its own verb
    args = ["frontier-report", *[a for a in args if a != "--report"]]
else:
    args = ["frontier", *args]
sys.exit(main(args))
