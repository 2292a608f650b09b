"""``s3://BUCKET/PREFIX`` -> a local model folder, with MinIO's Python client (any
S3-compatible store: AWS S3, MinIO, Ceph RGW, R2, GCS's XML API).

Configuration is the AWS SDKs' environment (the operator fills it from the Secret named
by ``model.credentialsSecret``):

=============================================  ==========================================
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``  static keys (optional
``AWS_SESSION_TOKEN``)                             ``AWS_SESSION_TOKEN``)
``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``  IRSA / workload identity (no keys)
neither                                           anonymous (a public bucket)
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``   another store (``http(s)://HOST[:PORT]``);
                                                  default ``https://s3.amazonaws.com``
``AWS_REGION`` or ``AWS_DEFAULT_REGION``          the bucket's region (found if unset)
=============================================  ==========================================

Only the model files (:data:`kvpilot.fetch.files.MODEL_FILE_PATTERNS`) under ``PREFIX/``
are fetched, keeping their relative paths. A file already present with the listed size is
kept (a restarted init container resumes); each object is written to a temporary file and
renamed when complete (the client's own ``.part.minio`` file).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.credentials import IamAwsProvider, Provider, StaticProvider
from minio.error import MinioException, S3Error
from urllib3.exceptions import HTTPError as Urllib3Error

from kvpilot.fetch.errors import FetchError
from kvpilot.fetch.files import MODEL_FILE_PATTERNS, human_bytes, local_path, wanted
from kvpilot.fetch.progress import Progress
from kvpilot.fetch.uris import S3Location

AWS_HOST = "s3.amazonaws.com"
# (connect, read) seconds per request; read is the longest silence while an object streams.
REQUEST_TIMEOUT = (15, 120)
_CREDENTIAL_HINT = ("set model.credentialsSecret to a Secret with AWS_ACCESS_KEY_ID and"
                    " AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a store other than AWS)")


def s3_client(env: Mapping[str, str] = os.environ) -> Minio:
    """A client for the store ``env`` names (module docstring). Raises FetchError for an
    endpoint that is not ``http(s)://HOST[:PORT]``."""
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    host, secure = AWS_HOST, True
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
            raise FetchError(f"AWS_ENDPOINT_URL {endpoint!r}: use http(s)://HOST[:PORT]"
                             " (no path)")
        host, secure = parts.netloc, parts.scheme == "https"
    provider: Provider | None = None
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        provider = StaticProvider(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                  env.get("AWS_SESSION_TOKEN") or None)
    elif env.get("AWS_WEB_IDENTITY_TOKEN_FILE") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        provider = IamAwsProvider()
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None
    # MinIO's own pool, with its retries, but 5 minutes of silence per attempt would hold
    # the init container for half an hour against a store that never answers.
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=REQUEST_TIMEOUT[0], read=REQUEST_TIMEOUT[1]), maxsize=10,
        cert_reqs="CERT_REQUIRED", ca_certs=env.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]))
    return Minio(host, credentials=provider, secure=secure, region=region, http_client=http)


def _describe(exc: Exception, location: S3Location) -> str:
    if isinstance(exc, S3Error):
        hint = ""
        if exc.code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                        "ExpiredToken", "AllAccessDisabled"):
            hint = f": check the credentials ({_CREDENTIAL_HINT})"
        elif exc.code == "NoSuchBucket":
            hint = ": check the bucket name and AWS_ENDPOINT_URL"
        return f"{location.uri}: S3 error {exc.code}: {exc.message}{hint}"
    return f"{location.uri}: {type(exc).__name__}: {exc}"


def fetch_s3(location: S3Location, dest: Path, log: Callable[[str], None],
             client: Minio | None = None) -> int:
    """Download the model files under ``location`` into ``dest`` (created); returns the
    number of files. Raises FetchError naming the URI when the store cannot be reached,
    refuses the credentials, has no such bucket, or holds no model file there."""
    client = client or s3_client()
    prefix = f"{location.prefix}/" if location.prefix else ""
    try:
        listed = [o for o in client.list_objects(location.bucket, prefix=prefix, recursive=True)
                  if not o.is_dir and o.object_name]
    except (MinioException, Urllib3Error, OSError) as exc:
        raise FetchError(_describe(exc, location)) from exc
    files = [(o.object_name[len(prefix):], o.object_name, int(o.size or 0))
             for o in listed if wanted(o.object_name[len(prefix):])]
    if not files:
        seen = ", ".join(o.object_name for o in listed[:5]) or "nothing"
        raise FetchError(f"{location.uri}: no model file ({', '.join(MODEL_FILE_PATTERNS)})"
                         f" under {prefix or 'the bucket root'}; found {seen}")
    paths = [(rel, key, size, local_path(dest, rel)) for rel, key, size in files]
    total = sum(size for *_, size, _ in paths)
    log(f"fetch {location.uri}: {len(paths)} files, {human_bytes(total)} -> {dest}")
    progress = Progress(location.uri, len(paths), total, log)
    for rel, key, size, path in paths:
        if path.is_file() and path.stat().st_size == size:
            progress.start_file(f"{rel} (already here)", size)
            progress.add(size)
            continue
        progress.start_file(rel, size)
        try:
            client.fget_object(location.bucket, key, str(path), progress=progress)
        except (MinioException, Urllib3Error, OSError) as exc:
            raise FetchError(_describe(exc, location)) from exc
    progress.finish()
    return len(paths)
