"""The pure parts of `kvpilot fetch-model`: URI grammar, which files are fetched and where
they may land, and the progress lines of the pod log."""

from __future__ import annotations

import pytest

from kvpilot.fetch import FetchError, fetch_model
from kvpilot.fetch.files import human_bytes, local_path, wanted
from kvpilot.fetch.progress import Progress
from kvpilot.fetch.uris import OciReference, S3Location, parse_oci, parse_s3


@pytest.mark.parametrize(("uri", "bucket", "prefix", "name"), [
    ("s3://models", "models", "", "models"),
    ("s3://models/", "models", "", "models"),
    ("s3://my.models-1/llama/llama-3-8b/", "my.models-1", "llama/llama-3-8b", "llama-3-8b"),
])
def test_s3_uris(uri, bucket, prefix, name):
    location = parse_s3(uri)
    assert location == S3Location(bucket, prefix) and location.name == name


@pytest.mark.parametrize("uri", ["s3://", "s3://ab", "s3://Models/x", "s3://b_b/x",
                                 "s3://bucket/a/../b", "s3://bucket/a//b", "s3://bucket/./a",
                                 "s3://bucket/a b"])
def test_bad_s3_uris_name_the_uri_and_the_form(uri):
    with pytest.raises(ValueError, match="model URI"):
        parse_s3(uri)


DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(("uri", "ref", "reference"), [
    ("oci://ghcr.io/acme/llama3", OciReference("ghcr.io", "acme/llama3", "latest", None),
     "ghcr.io/acme/llama3:latest"),
    ("oci://registry.local:5000/m/qwen:v1.2", OciReference("registry.local:5000", "m/qwen", "v1.2", None),
     "registry.local:5000/m/qwen:v1.2"),
    (f"oci://r.io/a@{DIGEST}", OciReference("r.io", "a", None, DIGEST), f"r.io/a@{DIGEST}"),
])
def test_oci_references(uri, ref, reference):
    parsed = parse_oci(uri)
    assert parsed == ref and parsed.reference == reference
    assert parsed.name == ref.repository.rsplit("/", 1)[-1]


@pytest.mark.parametrize("uri", ["oci://ghcr.io", "oci://ghcr.io/Acme/x", "oci://ghcr.io/a:b:c",
                                 "oci://ghcr.io/a@sha256:abc", "oci:///a/b"])
def test_bad_oci_uris(uri):
    with pytest.raises(ValueError, match="model URI"):
        parse_oci(uri)


def test_unknown_schemes_and_bad_uris_are_fetch_errors(tmp_path):
    with pytest.raises(FetchError, match="use s3://BUCKET"):
        fetch_model("gs://bucket/x", tmp_path, print)
    with pytest.raises(FetchError, match="model URI 's3://B'"):
        fetch_model("s3://B", tmp_path, print)


def test_only_model_files_are_wanted():
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json",
                 "tokenizer.model", "merges.txt", "sub/model.gguf", "tokenizer_config.json"):
        assert wanted(name), name
    for name in ("pytorch_model.bin", "model.pth", "optimizer.pt", "README.md", "logs/run.log"):
        assert not wanted(name), name


def test_remote_names_cannot_leave_the_destination(tmp_path):
    assert local_path(tmp_path, "sub/config.json") == tmp_path / "sub" / "config.json"
    for bad in ("", "/etc/passwd", "../x", "a/../../x", "a//b", "./a"):
        with pytest.raises(ValueError, match="refusing remote file name"):
            local_path(tmp_path, bad)


def test_progress_lines_say_bytes_share_rate_and_time_left():
    lines: list[str] = []
    now = [0.0]
    progress = Progress("s3://b/m", 2, 4 << 20, lines.append, interval=5.0, clock=lambda: now[0])
    progress.start_file("model.safetensors", 3 << 20)
    now[0] = 1.0
    progress.update(1 << 20)  # within the interval: no line
    assert lines == ["fetch s3://b/m: [1/2] model.safetensors (3.0 MiB)"]
    now[0] = 6.0
    progress.update(1 << 20)
    assert lines[-1] == "fetch s3://b/m: 2.0 MiB of 4.0 MiB (50%), 341.3 KiB/s, 6 s left"
    progress.finish()
    assert lines[-1] == "fetch s3://b/m: done, 2 files, 2.0 MiB in 6.0 s"
    assert human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"


def test_a_registry_needs_a_dot_or_a_port():
    # To the kubelet, "zot/models/llama" is docker.io/zot/models/llama.
    with pytest.raises(ValueError, match="needs a dot or a port"):
        parse_oci("oci://zot/models/llama:v1")
    assert parse_oci("oci://localhost:5000/m:v1").registry == "localhost:5000"
