"""Parse the object-store and registry model URIs (standard library only: the operator
validates specs with these, the init container downloads with them).

=====================================================  =====================================
URI                                                    meaning
=====================================================  =====================================
``s3://BUCKET[/PREFIX]``                               every model file under ``PREFIX/``
                                                       in ``BUCKET`` (AWS S3 or any
                                                       S3-compatible store)
``oci://REGISTRY[:PORT]/REPOSITORY[:TAG|@DIGEST]``     a model packaged as an OCI artifact
                                                       or image (tag ``latest`` if none)
=====================================================  =====================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# S3 bucket names (the AWS rules that matter here: 3-63 of lowercase, digits, dots, hyphens).
_BUCKET = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
_S3 = re.compile(rf"^s3://({_BUCKET})(?:/(\S*))?$")
# OCI distribution-spec grammar (registry host, repository path, tag, digest).
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?))*(?::[0-9]{1,5})?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_OCI = re.compile(
    rf"^oci://({_HOST})/({_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::([A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?(?:@(sha256:[a-f0-9]{64}))?$")

S3_FORM = "s3://BUCKET[/PREFIX]"
OCI_FORM = "oci://REGISTRY[:PORT]/REPOSITORY[:TAG|@sha256:DIGEST]"


@dataclass(frozen=True)
class S3Location:
    """Attributes: bucket; prefix ('' = the whole bucket, else without a trailing '/')."""

    bucket: str
    prefix: str

    @property
    def name(self) -> str:
        """The model's folder name: the prefix's last segment, else the bucket."""
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else self.bucket

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class OciReference:
    """Attributes: registry (host[:port]); repository; tag (None with a digest alone);
    digest (``sha256:...`` or None)."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        """The model's folder name: the repository's last segment."""
        return self.repository.rsplit("/", 1)[-1]

    @property
    def reference(self) -> str:
        """``REGISTRY/REPOSITORY[:TAG][@DIGEST]``, as an image reference."""
        ref = f"{self.registry}/{self.repository}"
        if self.tag:
            ref += f":{self.tag}"
        if self.digest:
            ref += f"@{self.digest}"
        return ref


def parse_s3(uri: str) -> S3Location:
    """Raises ValueError naming the URI and the form."""
    m = _S3.fullmatch(uri)
    if not m:
        raise ValueError(f"model URI {uri!r}: use {S3_FORM} (a bucket name of 3-63 lowercase"
                         " letters, digits, dots and hyphens)")
    prefix = (m.group(2) or "").strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"model URI {uri!r}: the prefix may not contain empty, '.' or '..'"
                         " segments")
    return S3Location(m.group(1), prefix)


def parse_oci(uri: str) -> OciReference:
    """Raises ValueError naming the URI and the form."""
    m = _OCI.fullmatch(uri)
    if not m:
        raise ValueError(f"model URI {uri!r}: use {OCI_FORM} (lowercase repository path)")
    if "." not in m.group(1) and ":" not in m.group(1):
        # Docker's rule: a first component without a dot or a port is a Docker Hub
        # namespace to the kubelet, not a registry (an image volume would pull elsewhere).
        raise ValueError(f"model URI {uri!r}: the registry {m.group(1)!r} needs a dot or a"
                         " port (registry.example.com, localhost:5000)")
    tag, digest = m.group(3), m.group(4)
    return OciReference(m.group(1), m.group(2), tag if tag or digest else "latest", digest)
