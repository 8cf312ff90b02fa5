"""``python -m tilescale_lang.aot``: build a bundle, export it to C, or show its manifest.

    python -m tilescale_lang.aot build SPEC.json -o DIR [--arch sm_90a ...]
    python -m tilescale_lang.aot dump-c DIR -o OUT [--prefix NAME]
    python -m tilescale_lang.aot show DIR
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tilescale_lang.aot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile the kernels a JSON spec declares into a bundle")
    build.add_argument("spec", help="the JSON spec file (see docs/aot.md)")
    build.add_argument("-o", "--out", required=True, help="the bundle directory (new, empty, or a bundle)")
    build.add_argument("--arch", action="append", help="target architecture, repeatable (default: the spec's)")
    dump = sub.add_parser("dump-c", help="write a C header and source launching the bundle's kernels")
    dump.add_argument("bundle", help="the bundle directory")
    dump.add_argument("-o", "--out", required=True, help="directory for <prefix>.h and <prefix>.c")
    dump.add_argument("--prefix", help="C prefix of the generated names (default: the bundle's name)")
    show = sub.add_parser("show", help="print a bundle's key and kernels")
    show.add_argument("bundle", help="the bundle directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success)."""
    args = _parser().parse_args(argv)
    if args.command == "build":
        from .builder import build

        path = build(args.spec, args.out, archs=args.arch, progress=print)
        print(f"wrote {path}")
    elif args.command == "dump-c":
        from .cexport import dump_c

        for path in dump_c(args.bundle, args.out, prefix=args.prefix):
            print(f"wrote {path}")
    else:
        from .manifest import read_manifest

        manifest = read_manifest(args.bundle)
        print(" ".join(f"{k}={v}" for k, v in manifest["key"].items()))
        for entry in manifest["kernels"]:
            table = " table" if entry["table"]["needed"] else ""
            print(f"{entry['id']}  {entry['entry']}  {entry['args']}  [{', '.join(entry['archs'])}]{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
