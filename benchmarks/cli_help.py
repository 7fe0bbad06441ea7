"""How fast `mxd-lens [SUB] --help` answers, beside the cost of the imports it avoids, in one run.

    python benchmarks/cli_help.py

Prints, per subcommand, the best of 3 wall times of `mxd-lens SUB --help` in a fresh interpreter and
its ratio to `python -c "import mxd_lens.layers"` (torch + SAELens + TransformerLens: what the help
used to import), measured side by side.
"""

from __future__ import annotations

import subprocess
import sys
import time


def commands() -> list[str]:
    """Every verb: the built-in commands and every registered study."""
    from mxd_lens.cli import build_parser
    from mxd_lens.studies import STUDIES

    parser = build_parser(only="")  # the verbs without their options
    sub = next(a for a in parser._actions if a.dest == "command")
    return ["", *sorted(set(sub.choices) | set(STUDIES))]


def best_of(argv: list[str], n: int = 3) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    heavy = best_of([sys.executable, "-c", "import mxd_lens.layers"])
    print(f"reference: import mxd_lens.layers (torch, SAELens, TransformerLens) {heavy:.2f} s")
    print(f"{'command':<38} {'seconds':>8} {'/ reference':>12}")
    for command in commands():
        argv = [sys.executable, "-m", "mxd_lens.cli", *([command] if command else []), "--help"]
        seconds = best_of(argv)
        print(
            f"{'mxd-lens ' + (command + ' ' if command else '') + '--help':<38} {seconds:>8.2f} {seconds / heavy:>12.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
