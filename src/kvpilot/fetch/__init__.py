"""Fetch a model from an object store or a registry into a local folder: what the engine
pod's ``model-download`` init container runs (``kvpilot fetch-model URI DEST``), and what a
user can run by hand.

=========================================  ================================================
``s3://BUCKET[/PREFIX]``                   :mod:`kvpilot.fetch.s3` (MinIO's S3 client)
``oci://REGISTRY/REPO[:TAG|@DIGEST]``      :mod:`kvpilot.fetch.oci` (oras-py)
=========================================  ================================================

Progress goes to the log (one line per file, one every 5 s with bytes, rate and time
left); every failure is a :class:`FetchError` whose message names the URI and what to
check. The clients are imported only for the scheme asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvpilot.fetch.errors import FetchError
from kvpilot.fetch.uris import OCI_FORM, S3_FORM, parse_oci, parse_s3

__all__ = ["FetchError", "fetch_model"]


def fetch_model(uri: str, dest: Path, log: Callable[[str], None],
                plain_http: bool = False) -> int:
    """Fetch ``uri`` into ``dest``; returns the number of files (or layers). ``plain_http``:
    talk HTTP, not HTTPS, to an OCI registry. Raises FetchError (a bad URI included)."""
    try:
        if uri.startswith("s3://"):
            location = parse_s3(uri)
            from kvpilot.fetch.s3 import fetch_s3
            return fetch_s3(location, dest, log)
        if uri.startswith("oci://"):
            ref = parse_oci(uri)
            from kvpilot.fetch.oci import fetch_oci
            return fetch_oci(ref, dest, log, plain_http=plain_http)
    except ValueError as exc:
        raise FetchError(str(exc)) from None
    raise FetchError(f"cannot fetch {uri!r}: use {S3_FORM} or {OCI_FORM}")
