"""`kvpilot fetch-model oci://...` against a real OCI registry (go-containerregistry's, over
plain HTTP on 127.0.0.1), for both packagings: an ORAS artifact (one file per layer) and an
image (tar layers, what an image volume mounts). Hostile layer names and corrupted blobs
are refused."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import oras.client
import oras.oci
import pytest

from kvpilot.fetch import FetchError
from kvpilot.fetch.oci import fetch_oci
from kvpilot.fetch.uris import parse_oci
from tests.fetch.servers import oci_registry

pytestmark = [pytest.mark.tools, pytest.mark.server]
KVPILOT = str(Path(sys.executable).with_name("kvpilot"))
WEIGHTS = os.urandom(2 << 20)


@pytest.fixture(scope="module")
def registry():
    with oci_registry() as host:
        yield host


def _client(host: str) -> oras.client.OrasClient:
    return oras.client.OrasClient(hostname=host, insecure=True)


def _push_artifact(host: str, repo: str, files: dict[str, bytes], workdir: Path,
                   monkeypatch) -> None:
    """``oras push`` of ``files`` (name -> bytes): one layer per file, titled by name."""
    for name, data in files.items():
        (workdir / name).write_bytes(data)
    monkeypatch.chdir(workdir)
    _client(host).push(target=f"{host}/{repo}", files=list(files), quiet=True)


def _push_manifest(host: str, repo: str, blobs: list[tuple[Path, dict]]) -> None:
    """An image manifest with the given (blob file, layer descriptor) layers."""
    client = _client(host)
    container = client.get_container(f"{host}/{repo}")
    manifest = oras.oci.NewManifest()
    for path, layer in blobs:
        client.upload_blob(str(path), container, layer)
        manifest["layers"].append(layer)
    config, _ = oras.oci.ManifestConfig()
    manifest["config"] = config
    empty = Path(str(blobs[0][0]) + ".config")
    empty.write_bytes(b"{}")
    client.upload_blob(str(empty), container, config)
    response = client.upload_manifest(manifest, container)
    assert response.status_code in (200, 201), response.text


def _image_layer(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, dict]:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "layer.tar.gz"
    path.write_bytes(gzip.compress(raw.getvalue()))
    layer = oras.oci.NewLayer(str(path), "application/vnd.oci.image.layer.v1.tar+gzip")
    layer.pop("annotations", None)  # an image layer: no title
    return path, layer


def fetch(uri: str, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([KVPILOT, "fetch-model", "--plain-http", uri, str(dest)],
                          capture_output=True, text=True, timeout=120)


def test_an_oras_artifact_arrives_file_by_file_with_progress(registry, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    _push_artifact(registry, "models/llama3:v1", {"config.json": b'{"model_type": "llama"}',
                                                 "model.safetensors": WEIGHTS,
                                                 "tokenizer.json": b"{}"}, src, monkeypatch)
    dest = tmp_path / "llama3"
    result = fetch(f"oci://{registry}/models/llama3:v1", dest)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors",
                                                      "tokenizer.json"]
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert f"fetch oci://{registry}/models/llama3:v1: 3 layers, 2.0 MiB ->" in result.stdout
    assert "done, 3 files" in result.stdout
    again = fetch(f"oci://{registry}/models/llama3:v1", dest)
    assert again.returncode == 0 and again.stdout.count("(already here)") == 3


def test_an_image_is_unpacked_at_the_folder_root(registry, tmp_path):
    layer = _image_layer(tmp_path, {"config.json": b"{}", "model.safetensors": WEIGHTS,
                                    ".wh.old": b""})
    _push_manifest(registry, "models/qwen:img", [layer])
    dest = tmp_path / "qwen"
    result = fetch(f"oci://{registry}/models/qwen:img", dest)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS


def test_a_layer_title_that_leaves_the_folder_is_refused(registry, tmp_path):
    blob = tmp_path / "evil"
    blob.write_bytes(b"x")
    layer = oras.oci.NewLayer(str(blob), "application/octet-stream")
    layer["annotations"] = {"org.opencontainers.image.title": "../../etc/evil"}
    _push_manifest(registry, "models/evil:v1", [(blob, layer)])
    result = fetch(f"oci://{registry}/models/evil:v1", tmp_path / "evil-model")
    assert result.returncode == 1
    assert "refusing remote file name '../../etc/evil'" in result.stderr
    assert not (tmp_path / "etc").exists()


@pytest.mark.parametrize(("uri", "message"), [
    ("oci://{host}/models/absent:v1", "cannot read the manifest"),
    ("oci://{host}/Models/x", "model URI"),
])
def test_failures_are_one_line_naming_the_reference(registry, tmp_path, uri, message):
    result = fetch(uri.format(host=registry), tmp_path / "m")
    assert result.returncode == 1, result.stdout
    last = result.stderr.strip().splitlines()[-1]  # oras-py may log a line of its own first
    assert last.startswith("kvpilot fetch-model: ") and "oci://" in last and message in last
    assert "Traceback" not in result.stderr


class _FakeRegistry:
    """The part of oras-py's Registry that reading a manifest uses (get_container,
    do_request, ...), serving ``get_manifest(reference)``'s dict as JSON bytes."""

    prefix = "https"
    auth = type("Auth", (), {"load_configs": staticmethod(lambda container: None)})()

    def get_container(self, name):
        return type("Container", (), {"manifest_url": lambda _self: name, "name": name})()

    def do_request(self, url, method="GET", headers=None, **kwargs):
        body = self.manifest_bytes(url.removeprefix("https://"))
        return type("Response", (), {"status_code": 200, "content": body})()

    def manifest_bytes(self, ref):
        return json.dumps(self.get_manifest(ref)).encode()

    def _check_200_response(self, response):
        assert response.status_code == 200


class _CorruptingClient(_FakeRegistry):
    """Serves a manifest with one file layer whose bytes do not match its digest."""

    def get_manifest(self, ref):
        return {"mediaType": "application/vnd.oci.image.manifest.v1+json", "layers": [
            {"mediaType": "application/octet-stream", "digest": "sha256:" + "0" * 64,
             "size": 5, "annotations": {"org.opencontainers.image.title": "config.json"}}]}

    def download_blob(self, container, digest, outfile):
        Path(outfile).write_bytes(b"wrong")
        return outfile


def test_a_blob_that_does_not_match_its_digest_is_refused(tmp_path):
    with pytest.raises(FetchError, match="do not match the digest"):
        fetch_oci(parse_oci("oci://r.io/m/x:v1"), tmp_path, print, client=_CorruptingClient())
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial download


def test_an_index_resolves_to_its_first_real_platform(tmp_path):
    seen = []

    class IndexClient(_CorruptingClient):
        def get_manifest(self, ref):
            seen.append(ref)
            if len(seen) == 1:
                return {"mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
                    {"digest": "sha256:" + "1" * 64, "platform": {"os": "unknown"}},
                    {"digest": CHILD, "platform": {"os": "linux"}}]}
            self.data = data
            return child

        def download_blob(self, container, digest, outfile):
            Path(outfile).write_bytes(self.data)
            return outfile

    import hashlib

    data = json.dumps({"model_type": "x"}).encode()
    child = {"layers": [{"mediaType": "application/octet-stream",
                         "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data),
                         "annotations": {"org.opencontainers.image.title": "config.json"}}]}
    CHILD = "sha256:" + hashlib.sha256(json.dumps(child).encode()).hexdigest()
    fetch_oci(parse_oci("oci://r.io/m/x:v1"), tmp_path, print, client=IndexClient())
    assert seen == ["r.io/m/x:v1", f"r.io/m/x@{CHILD}"]
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "x"}


def test_a_registry_that_never_answers_fails_the_fetch(tmp_path, monkeypatch):
    """Found by a fresh-user trial: oras-py sends requests without a timeout, so a
    registry that accepts the connection and stays silent held the init container
    forever. Each request now times out (oras-py's retries then give up)."""
    import socket
    import time

    import kvpilot.fetch.oci as oci

    monkeypatch.setattr(oci, "REQUEST_TIMEOUT", (1, 1))
    monkeypatch.setattr("oras.decorator.time.sleep", lambda seconds: None)  # its retry back-off
    with socket.socket() as silent:  # the kernel completes the handshake; nobody reads
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(FetchError, match=rf"oci://127.0.0.1:{port}/m/x:v1: cannot read the manifest: "
                                             r".*(ReadTimeout|timed out)"):
            fetch_oci(parse_oci(f"oci://127.0.0.1:{port}/m/x:v1"), tmp_path / "m", print, plain_http=True)
        assert time.monotonic() - started < 30


def test_a_pinned_manifest_digest_is_checked(tmp_path):
    """Found by a fresh-user trial: with ``@sha256:`` pinned, a registry answering with
    another manifest (v2 for v1) was trusted, and its layers, checked only against that
    manifest, were written. The manifest's bytes must hash to the pinned digest."""
    import hashlib

    class SwappingClient(_CorruptingClient):
        def manifest_bytes(self, ref):
            return json.dumps({"layers": []}).encode()  # not the manifest pinned below

    pinned = "sha256:" + hashlib.sha256(b'{"layers": [1]}').hexdigest()
    dest = tmp_path / "m"
    with pytest.raises(FetchError, match=f"the registry's manifest does not match the digest {pinned}"):
        fetch_oci(parse_oci(f"oci://r.io/m/x@{pinned}"), dest, print, client=SwappingClient())
    assert not dest.exists()


def test_a_layer_digest_that_is_not_a_sha256_is_refused_before_any_write(tmp_path):
    class PathDigest(_CorruptingClient):
        def get_manifest(self, ref):
            return {"layers": [{"mediaType": "application/octet-stream",
                                "digest": "sha256:x/../../victim.txt", "size": 1,
                                "annotations": {"org.opencontainers.image.title": "a.json"}}]}
    dest = tmp_path / "m"
    with pytest.raises(FetchError, match="is not sha256:<64 hex digits>"):
        fetch_oci(parse_oci("oci://r.io/m/x:v1"), dest, print, client=PathDigest())
    assert not any(tmp_path.rglob("*.part"))
