"""``python -m ddo presets`` lists the presets; ``python -m ddo inspect PATH`` lists a
checkpoint's tensors, or says why it is invalid (exit 1)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import _native


def _printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped: names come from the file
    and must not drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="list the presets and their values")
    inspect = sub.add_parser("inspect", help="list a checkpoint's tensors")
    inspect.add_argument("path", help="a .safetensors file, an index .json, or a model folder")
    args = parser.parse_args(argv)
    if args.command == "presets":
        print(_native.format_presets(), end="")
        return 0
    try:
        info = json.loads(_native.inspect_checkpoint(args.path))
    except _native.DynamicOffloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tensors = [dict(t, name=_printable(t["name"]), file=_printable(t["file"])) for t in info["tensors"]]
    width = max([len(t["name"]) for t in tensors] + [4])
    print(f"{'name':<{width}}  {'dtype':<7}  {'shape':<20}  {'bytes':>12}  file")
    for t in tensors:
        shape = str(list(t["shape"]))
        print(f"{t['name']:<{width}}  {t['dtype']:<7}  {shape:<20}  {t['len']:>12}  {t['file'].rsplit('/', 1)[-1]}")
    total = sum(t["len"] for t in tensors)
    print(f"{len(tensors)} tensors in {len(info['files'])} file(s), {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
