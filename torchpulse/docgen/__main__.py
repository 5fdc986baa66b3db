"""`python -m torchpulse.docgen [--check] [--root DIR]`: write the generated docs, or say which are stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchpulse.docgen import stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchpulse.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    parser.add_argument("--root", type=Path, default=Path(), help="the repository's root (default: here)")
    args = parser.parse_args(argv)
    if args.check:
        old = stale(args.root)
        for path in old:
            print(f"{path} is stale: run `make docs`", file=sys.stderr)
        return 1 if old else 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
