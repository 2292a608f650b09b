"""``kvpilot fetch-model URI DEST``: download a model from S3 or an OCI registry (the
engine pod's init container runs it; see :mod:`kvpilot.fetch`). Exit status 0 when every
file arrived, 1 with one line naming the URI and the cause otherwise."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpilot.fetch import FetchError, fetch_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uri", help="s3://BUCKET[/PREFIX] or oci://REGISTRY/REPO[:TAG|@DIGEST]")
    parser.add_argument("dest", type=Path, help="the local folder (created)")
    parser.add_argument("--plain-http", action="store_true",
                        help="talk HTTP instead of HTTPS to the OCI registry")


def _log(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        fetch_model(args.uri, args.dest, _log, plain_http=args.plain_http)
    except FetchError as exc:
        print(f"kvpilot fetch-model: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
