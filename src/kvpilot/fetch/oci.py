"""``oci://REGISTRY/REPOSITORY[:TAG|@DIGEST]`` -> a local model folder, with oras-py (the
ORAS project's client of the OCI distribution API).

Two packagings are understood, the two a model is published in:

* **an OCI artifact** (``oras push REGISTRY/REPO:TAG config.json model.safetensors ...``):
  each layer is one file named by its ``org.opencontainers.image.title`` annotation (a
  directory pushed by oras is a tar+gzip layer with ``io.deis.oras.content.unpack``, and is
  unpacked under its title);
* **an image** (``FROM scratch`` + ``COPY model/ /``, what an image volume mounts): each
  layer is a tar (plain or gzip) unpacked in order at the folder's root. The model's files
  are at the image's root.

An image index (several platforms) resolves to its first manifest for a real platform.
Every blob is written to a temporary file, checked against its sha256 digest, then moved
or unpacked (tarfile's ``data`` filter: no absolute paths, links out of the folder or
device files); a layer whose file is already present with its size is skipped. Registry
credentials, when needed, come from ``KVPILOT_OCI_USERNAME`` / ``KVPILOT_OCI_PASSWORD``
(the operator fills them from ``model.credentialsSecret``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import oras.client
import oras.defaults
import requests

from kvpilot.fetch.errors import FetchError
from kvpilot.fetch.files import human_bytes, local_path
from kvpilot.fetch.progress import FileWatcher, Progress
from kvpilot.fetch.uris import OciReference

TITLE = "org.opencontainers.image.title"
UNPACK = "io.deis.oras.content.unpack"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
TAR_TYPES = ("application/vnd.oci.image.layer.v1.tar",
             "application/vnd.oci.image.layer.v1.tar+gzip",
             "application/vnd.docker.image.rootfs.diff.tar.gzip",
             "application/vnd.docker.image.rootfs.diff.tar")
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$")
USERNAME_ENV, PASSWORD_ENV = "KVPILOT_OCI_USERNAME", "KVPILOT_OCI_PASSWORD"
# (connect, read) seconds for each registry request; read is the longest silence allowed
# while a blob streams, not the time a whole blob may take.
REQUEST_TIMEOUT = (15, 120)


def oci_client(ref: OciReference, plain_http: bool = False,
               env: Mapping[str, str] = os.environ) -> oras.client.OrasClient:
    """An ORAS client for ``ref``'s registry (HTTPS unless ``plain_http``), with basic
    credentials from the environment when both are set."""
    client = oras.client.OrasClient(hostname=ref.registry, insecure=plain_http)
    if env.get(USERNAME_ENV) and env.get(PASSWORD_ENV):
        client.auth.set_basic_auth(env[USERNAME_ENV], env[PASSWORD_ENV])
    # oras-py sends its requests without a timeout: a registry that accepts the connection
    # and never answers would hold the init container forever.
    request = client.session.request

    def timed(method: str, url: str, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", REQUEST_TIMEOUT)
        return request(method, url, **kwargs)

    client.session.request = timed
    return client


def _get_manifest(client: oras.client.OrasClient, reference: str, digest: str | None) -> dict[str, Any]:
    """The manifest ``reference`` names, as oras-py's ``get_manifest`` reads it, but from
    its bytes, which must hash to ``digest`` when one is given: a pinned digest is what the
    user trusts, and the layers' digests come from this manifest (containerd checks the
    same). Raises FetchError on a mismatch."""
    container = client.get_container(reference)
    client.auth.load_configs(container)
    accept = ", ".join(oras.defaults.default_manifest_accepted_media_types)
    response = client.do_request(f"{client.prefix}://{container.manifest_url()}", "GET",
                                 headers={"Accept": accept})
    client._check_200_response(response)
    body: bytes = response.content
    if digest is not None and f"sha256:{hashlib.sha256(body).hexdigest()}" != digest:
        raise FetchError(f"oci://{reference}: the registry's manifest does not match the digest {digest}")
    manifest: dict[str, Any] = json.loads(body)
    return manifest


def _manifest(client: oras.client.OrasClient, ref: OciReference) -> dict[str, Any]:
    """The image or artifact manifest; an index resolves to its first real platform.
    Every manifest read by digest (the pinned one, an index's entry) is checked against it."""
    manifest = _get_manifest(client, ref.reference, ref.digest)
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        entries = manifest.get("manifests") or []
        real = [m for m in entries if (m.get("platform") or {}).get("os") not in ("unknown",)]
        if not real or not _DIGEST.match(str(real[0].get("digest", ""))):
            raise FetchError(f"oci://{ref.reference}: the image index lists no usable manifest")
        child = f"{ref.registry}/{ref.repository}@{real[0]['digest']}"
        manifest = _get_manifest(client, child, real[0]["digest"])
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _unpack(archive: Path, dest: Path) -> None:
    """Unpack a layer tar (any compression) under ``dest``; whiteouts are skipped."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if not Path(m.name).name.startswith(".wh.") and (m.isfile() or m.isdir())]
        tar.extractall(dest, members=members, filter="data")


def fetch_oci(ref: OciReference, dest: Path, log: Callable[[str], None],
              client: oras.client.OrasClient | None = None, plain_http: bool = False) -> int:
    """Pull ``ref`` into ``dest`` (created); returns the number of layers. Raises
    FetchError naming the reference when the registry cannot be reached or refuses, a
    blob does not match its digest, or a layer names a path outside ``dest``."""
    client = client or oci_client(ref, plain_http)
    uri = f"oci://{ref.reference}"
    try:
        layers = _manifest(client, ref).get("layers") or []
    except (requests.RequestException, ValueError, KeyError) as exc:
        raise FetchError(f"{uri}: cannot read the manifest: {type(exc).__name__}: {exc}") from exc
    if not layers:
        raise FetchError(f"{uri}: the manifest has no layers (nothing to fetch)")
    dest.mkdir(parents=True, exist_ok=True)
    total = sum(int(layer.get("size") or 0) for layer in layers)
    log(f"fetch {uri}: {len(layers)} layer{'' if len(layers) == 1 else 's'}, {human_bytes(total)} -> {dest}")
    progress = Progress(uri, len(layers), total, log)
    for layer in layers:
        digest, size = str(layer.get("digest", "")), int(layer.get("size") or 0)
        if not _DIGEST.match(digest):  # it names a file below: nothing but a sha256 digest
            raise FetchError(f"{uri}: layer digest {digest!r} is not sha256:<64 hex digits>")
        title = (layer.get("annotations") or {}).get(TITLE)
        unpack = layer.get("mediaType") in TAR_TYPES and (
            not title or (layer.get("annotations") or {}).get(UNPACK) == "true")
        try:
            target = local_path(dest, title) if title else None
        except ValueError as exc:
            raise FetchError(f"{uri}: layer {digest}: {exc}") from exc
        if target is not None and not unpack and target.is_file() and target.stat().st_size == size:
            progress.start_file(f"{title} (already here)", size)
            progress.add(size)
            continue
        progress.start_file(title or f"image layer {digest[:19]}", size)
        part = dest / f".{digest.replace(':', '-')}.part"
        watcher = FileWatcher(progress, part)
        try:
            client.download_blob(f"{ref.registry}/{ref.repository}", digest, str(part))
        except (requests.RequestException, OSError) as exc:
            raise FetchError(f"{uri}: layer {digest}: {type(exc).__name__}: {exc}") from exc
        finally:
            watcher.stop()
        if _sha256(part) != digest:
            part.unlink(missing_ok=True)
            raise FetchError(f"{uri}: layer {digest}: the downloaded bytes do not match the digest")
        if unpack:
            try:
                _unpack(part, target or dest)
            except (tarfile.TarError, OSError) as exc:
                raise FetchError(f"{uri}: layer {digest}: cannot unpack: {exc}") from exc
            finally:
                part.unlink(missing_ok=True)
        else:
            if target is None:
                part.unlink(missing_ok=True)
                raise FetchError(f"{uri}: layer {digest} has no title and is not an image layer"
                                 f" (mediaType {layer.get('mediaType')!r}); supported image layers:"
                                 f" {', '.join(TAR_TYPES)}")
            target.parent.mkdir(parents=True, exist_ok=True)
            part.replace(target)
    progress.finish()
    return len(layers)
