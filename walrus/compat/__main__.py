"""``python -m walrus.compat convert OFFICIAL.pt OUT.ckpt [--fields F] [--config C] [--trust-pickle]
[--overwrite]``."""

from __future__ import annotations

import argparse
import sys

from walrus.compat.convert import convert_file
from walrus.compat.released import config_beside
from walrus.errors import RESOURCE_ERRORS, DiskFullError


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m walrus.compat", description="Use official Walrus weights."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser(
        "convert",
        help="convert an official checkpoint (legacy or current layout, e.g. the released "
        "walrus.pt) into a walrus checkpoint",
    )
    conv.add_argument("official", help="official checkpoint file (.pt), downloaded by you")
    conv.add_argument("out", help="walrus checkpoint to write (.ckpt)")
    conv.add_argument(
        "--fields",
        help="YAML/JSON: the official field names, one per embedding index (a list, a name: "
        "index mapping, or an official config with field_index_map or "
        "data.field_index_map_override); current layout default: the config's map, else the "
        "released 67-field vocabulary when the sizes match",
    )
    conv.add_argument(
        "--config",
        help="official config YAML/JSON, checked against the weights; default: the "
        "extended_config.yaml beside the checkpoint, else (current layout) the released model's "
        "settings",
    )
    conv.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow pickled Python objects in the file (runs code from it; only for trusted files)",
    )
    conv.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output file (never the input itself)",
    )
    args = parser.parse_args(argv)
    config = args.config or config_beside(args.official)
    if config is not None and args.config is None:
        print(f"config: {config} (found beside {args.official})")
    try:
        report = convert_file(
            args.official,
            args.out,
            fields=args.fields,
            config=config,
            trust_pickle=args.trust_pickle,
            overwrite=args.overwrite,
        )
    except (ValueError, FileNotFoundError, PermissionError, DiskFullError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a path too long
        if not e.filename:
            raise
        print(f"error: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except RESOURCE_ERRORS as e:
        print(
            f"error: {args.official} asks for more than this machine can give ({type(e).__name__})",
            file=sys.stderr,
        )
        return 2
    print(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
