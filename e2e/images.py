"""The project's container images for the real-node e2e, built from ``docker/`` with buildah
and imported into the node's containerd, rebuilt only when their inputs change.

What is built, in order (each once per content hash, cached outside the repository):

1. ``base``: Debian bookworm from ``debootstrap --variant=minbase`` with Python 3.11 (the
   release of ``python:3.11-slim``), its headers and a C compiler (Triton compiles kernel
   launchers at run time), and a virtual environment at ``/usr/local`` so that ``python``
   and ``pip`` are on ``PATH`` as in the ``python`` images. It is committed under
   ``docker.io/library/python:3.11-slim`` in the cache's own buildah store (never the
   system's), so ``docker/operator.Dockerfile`` and ``docker/router.Dockerfile`` build
   unchanged with ``--pull=false``; the engine image takes it through its ``CUDA_IMAGE``
   build argument with ``TARGET_DEVICE=cpu``: the CPU image a user builds the same way
   (no Triton, only the CUDA libraries ``import torch`` links, prebuilt CPU kernels).
2. ``pause``: the sandbox image containerd starts first in every pod
   (``registry.k8s.io/pause``), a static C program that waits for a signal.
3. ``engine``, ``operator``, ``router``: ``buildah bud --isolation chroot`` of the
   Dockerfiles, tagged ``docker.io/kvpilot/<name>:e2e-<hash>`` where the hash covers the
   Dockerfile, its ``.dockerignore`` and every file the build context lets in, plus the base.

The cache (``~/.cache/kvpilot/images``, or ``$KVPILOT_IMAGE_CACHE``) holds the buildah store.
:func:`import_into` copies an image into a containerd (``ctr images import`` of an
uncompressed OCI archive) unless that containerd already has it, so a containerd whose root
is cached too keeps its images between runs. ``make e2e-images`` (:mod:`e2e.prepare`) does
all of it before pytest starts, outside any test's timeout. The host's CA bundle and pip
configuration are mounted read-only into every ``RUN`` step, so builds work behind the same
TLS-inspecting proxy and package mirror as the host.

Errors: :class:`ImageBuildError` names the step and carries the tail of its output.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("e2e.images")
REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("KVPILOT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Python 3.11 + venv (the python:3.11-slim release); headers, gcc and libc headers for
# Triton's run-time launcher builds; CA certificates for pip.
BASE_PACKAGES = ("python3", "python3-venv", "python3-dev", "gcc", "libc6-dev",
                 "ca-certificates")
BASE_REF = "docker.io/library/python:3.11-slim"
SKIPPED_DIRS = {".git", ".venv", ".tools", "__pycache__", ".mypy_cache", ".ruff_cache",
                ".pytest_cache", ".hypothesis"}
PAUSE_REF = "registry.k8s.io/pause:3.10"
# Bumped when the base recipe changes, so every image built on it is rebuilt.
BASE_RECIPE = f"1 {SUITE} {' '.join(BASE_PACKAGES)} venv:/usr/local"
PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, quit); signal(SIGTERM, quit); signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


class ImageBuildError(RuntimeError):
    """A build step failed; the message names it and ends with its output."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVPILOT_IMAGE_CACHE",
                               Path.home() / ".cache" / "kvpilot" / "images"))


@dataclass(frozen=True)
class Image:
    """One project image: its Dockerfile under ``docker/`` and the reference it gets."""

    name: str  # engine | operator | router
    dockerfile: Path
    build_args: tuple[tuple[str, str], ...] = ()

    @property
    def repository(self) -> str:
        return f"docker.io/kvpilot/{self.name}"

    def context_files(self) -> list[Path]:
        """Every file of the repository the build context admits (``<Dockerfile>.dockerignore``:
        ``*`` then ``!`` re-includes, as BuildKit reads it), sorted."""
        ignore = Path(f"{self.dockerfile}.dockerignore")
        patterns = [line.strip() for line in ignore.read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("#")] if ignore.exists() else []
        files = []
        for top, dirs, names in os.walk(REPO):
            # Never part of a build context, and the bulk of the tree: not walked at all.
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            for name in names:
                path = Path(top) / name
                rel = path.relative_to(REPO).as_posix()
                included = True
                for pattern in patterns:
                    negate = pattern.startswith("!")
                    pat = (pattern[1:] if negate else pattern).rstrip("/")
                    if _matches(rel, pat):
                        included = negate
                if included:
                    files.append(path)
        return sorted(files)

    def tag(self) -> str:
        """``e2e-<first 16 hex of sha256>`` over the Dockerfile, the context and the base."""
        digest = hashlib.sha256()
        digest.update(BASE_RECIPE.encode())
        for key, value in self.build_args:
            digest.update(f"arg {key}={value}\n".encode())
        for path in [self.dockerfile, Path(f"{self.dockerfile}.dockerignore"),
                     *self.context_files()]:
            if path.exists():
                digest.update(path.relative_to(REPO).as_posix().encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
        return f"e2e-{digest.hexdigest()[:16]}"

    def ref(self) -> str:
        return f"{self.repository}:{self.tag()}"


def _matches(rel: str, pattern: str) -> bool:
    """A .dockerignore pattern against a repo-relative path (a directory matches its files)."""
    if pattern.startswith("**/"):
        tail = pattern[3:]
        parts = rel.split("/")
        return any(fnmatch.fnmatch("/".join(parts[i:i + 1]), tail) for i in range(len(parts)))
    if fnmatch.fnmatch(rel, pattern):
        return True
    return rel.startswith(pattern + "/")


ENGINE = Image("engine", REPO / "docker" / "engine.Dockerfile",
               (("CUDA_IMAGE", BASE_REF), ("TARGET_DEVICE", "cpu")))
OPERATOR = Image("operator", REPO / "docker" / "operator.Dockerfile")
ROUTER = Image("router", REPO / "docker" / "router.Dockerfile")
ALL = (ENGINE, OPERATOR, ROUTER)


class Builder:
    """buildah with the cache's own store (``--root``) and a throwaway ``--runroot``."""

    def __init__(self, cache: Path | None = None) -> None:
        self.cache = cache or cache_dir()
        self.root = self.cache / "storage"
        self.runroot = Path(tempfile.mkdtemp(prefix="kvpilot-buildah-run-"))
        self.logs = self.cache / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        for tool in ("buildah", "debootstrap", "gcc"):
            if shutil.which(tool) is None:
                raise ImageBuildError(f"{tool} is not installed: run scripts/install-tools.sh")

    def close(self) -> None:
        """Remove the run root. (Never ``buildah unmount --all``: the store is shared with
        any other build running at the same time.)"""
        shutil.rmtree(self.runroot, ignore_errors=True)

    def __enter__(self) -> Builder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _buildah(self, *args: str) -> list[str]:
        return ["buildah", "--root", str(self.root), "--runroot", str(self.runroot),
                "--storage-driver", "overlay", *args]

    def run(self, step: str, argv: list[str], *, timeout: float = 3600) -> str:
        """Run one step, its output in logs/<step>.log (the last run's); raise ImageBuildError."""
        log_path = self.logs / f"{step}.log"
        with open(log_path, "wb") as out:
            # A session of its own: at the bound the whole group goes (a RUN step's pip or
            # g++, not only buildah).
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                returncode: int | None = proc.wait(timeout=timeout)
                code = f"exit {returncode}"
            except BaseException as e:  # the bound, Ctrl-C or SIGTERM: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if not isinstance(e, subprocess.TimeoutExpired):
                    raise
                returncode, code = None, f"still running after {timeout:.0f} s, killed"
        if returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise ImageBuildError(f"{step} failed ({code}): {' '.join(argv[:6])} "
                                  f"...; last lines of {log_path}:\n{tail}")
        return log_path.read_text(errors="replace")

    def has(self, ref: str) -> bool:
        return subprocess.run(self._buildah("inspect", "--type", "image", ref),
                              capture_output=True, check=False).returncode == 0

    def _label(self, ref: str) -> str:
        """The recipe label an image was committed with ('' when absent)."""
        out = subprocess.run(self._buildah("inspect", "--type", "image", "--format",
                                           "{{index .ImageAnnotations \"dev.kvpilot.recipe\"}}",
                                           ref), capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    # ---- base and pause
    def ensure_base(self, timeout: float = 1800) -> str:
        """The python:3.11-slim stand-in (see the module docstring); built once per recipe."""
        if self._label(BASE_REF) == BASE_RECIPE:  # '' when the image is absent
            return BASE_REF
        rootfs = Path(tempfile.mkdtemp(prefix="kvpilot-rootfs-", dir=self.cache))
        try:
            log.info("images: debootstrap %s (minbase + %s)", SUITE, ",".join(BASE_PACKAGES))
            self.run("base-debootstrap", [
                "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                SUITE, str(rootfs), DEBIAN_MIRROR], timeout=timeout)
            self.run("base-venv", ["chroot", str(rootfs), "/usr/bin/python3", "-m", "venv",
                                   "/usr/local"])
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for item in (rootfs / leftover).glob("*"):
                    if item.is_file():
                        item.unlink()
            container = self.run("base-from", self._buildah("from", "scratch")).splitlines()[-1]
            try:
                mount = self.run("base-mount", self._buildah("mount", container)).splitlines()[-1]
                self.run("base-copy", ["cp", "-a", f"{rootfs}/.", mount])
                self.run("base-config", self._buildah(
                    "config", "--env", "PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:"
                    "/sbin:/bin", "--env", "LANG=C.UTF-8", "--cmd", "python3",
                    "--annotation", f"dev.kvpilot.recipe={BASE_RECIPE}", container))
                self.run("base-commit", self._buildah("commit", "--rm", container, BASE_REF))
            except BaseException:
                subprocess.run(self._buildah("rm", container), capture_output=True, check=False)
                raise
        finally:
            subprocess.run(["rm", "-rf", "--one-file-system", str(rootfs)], check=False)
        return BASE_REF

    def ensure_pause(self) -> str:
        if self.has(PAUSE_REF):
            return PAUSE_REF
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            source = Path(tmp) / "pause.c"
            source.write_text(PAUSE_C)
            binary = Path(tmp) / "pause"
            self.run("pause-cc", ["gcc", "-Os", "-static", "-o", str(binary), str(source)])
            container = self.run("pause-from", self._buildah("from", "scratch")).splitlines()[-1]
            self.run("pause-copy", self._buildah("copy", "--chmod", "0755", container,
                                                 str(binary), "/pause"))
            self.run("pause-config", self._buildah("config", "--entrypoint", '["/pause"]',
                                                   "--user", "65535:65535", container))
            self.run("pause-commit", self._buildah("commit", "--rm", container, PAUSE_REF))
        return PAUSE_REF

    # ---- project images
    def mounts(self) -> list[str]:
        """``--volume`` flags for the host's CA bundle and pip configuration (read-only)."""
        flags = []
        for host in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf"):
            if Path(host).is_file():
                flags += ["--volume", f"{host}:{host}:ro"]
        return flags

    def ensure(self, image: Image, timeout: float = 3600) -> str:
        """Build ``image`` unless its content-hash tag is already in the store; its ref.

        Raises:
            ImageBuildError: the build failed or ran past ``timeout`` seconds."""
        ref = image.ref()
        if self.has(ref):
            return ref
        self.ensure_base()
        args: list[str] = []
        for key, value in image.build_args:
            args += ["--build-arg", f"{key}={value}"]
        log.info("images: building %s", ref)
        self.run(f"build-{image.name}", self._buildah(
            "bud", "--isolation", "chroot", "--pull=false", "--layers=false", *self.mounts(),
            *args, "-f", str(image.dockerfile), "-t", ref, str(REPO)), timeout=timeout)
        self.prune(image.repository, keep=ref)
        return ref

    def prune(self, repository: str, keep: str) -> None:
        """Remove this store's other ``e2e-*`` builds of ``repository`` (an engine image is
        6.5 GB: one per source change would fill the disk), then dangling layers."""
        listed = subprocess.run(self._buildah("images", "--format", "{{.Name}}:{{.Tag}}"),
                                capture_output=True, text=True, check=False).stdout.split()
        for ref in listed:
            if ref.startswith(f"{repository}:e2e-") and ref != keep:
                subprocess.run(self._buildah("rmi", ref), capture_output=True, check=False)
        subprocess.run(self._buildah("rmi", "--prune"), capture_output=True, check=False)

    def export(self, ref: str, archive: Path) -> Path:
        """An OCI archive of ``ref`` whose index names it (what ``ctr images import`` reads).

        Layers are left uncompressed: the archive lives for one import on the same disk,
        and gzip (one core) then gunzip would be most of the time of both steps."""
        archive.unlink(missing_ok=True)
        self.run("export", self._buildah("push", "--quiet", "--disable-compression", ref,
                                         f"oci-archive:{archive}:{ref}"), timeout=3600)
        return archive


def prune_containerd(ctr: list[str], keep: list[str]) -> None:
    """Remove every image of the containerd ``ctr`` talks to but ``keep`` (and the CRI's
    ``sha256:<id>`` names of those); containerd's garbage collector then frees their
    content and unpacked layers."""
    lines = subprocess.run([*ctr, "images", "ls"], capture_output=True, text=True,
                           check=True).stdout.splitlines()[1:]
    rows = [line.split()[:3] for line in lines if line.strip()]
    kept_digests = {digest for ref, _, digest in rows if ref in keep}
    for ref, _, digest in rows:
        if ref not in keep and digest not in kept_digests:
            subprocess.run([*ctr, "images", "rm", ref], capture_output=True, check=False)


def _image_names(ctr: list[str]) -> list[str]:
    """Every image name the containerd ``ctr`` talks to holds."""
    return subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True,
                          check=True).stdout.split()


def import_into(builder: Builder, ref: str, ctr: list[str], *, timeout: float = 1800) -> bool:
    """Import ``ref`` into the containerd that ``ctr`` (argv prefix with address and namespace)
    talks to, unless it already holds that reference; True when it was imported.

    The archive is uncompressed (:meth:`Builder.export`) and imported with ``--base-name``
    of its repository, so exactly one image record is made, for the manifest the archive's
    ``org.opencontainers.image.ref.name`` names, and unpacked once. (``--index-name`` with
    the same name made a second record for the index under that name: each write replaced
    the other's target, the replaced blob was left unreferenced for containerd's garbage
    collector, and an unpack could find it gone or run twice.)

    Raises:
        ImageBuildError: the import failed or took longer than ``timeout`` seconds, or
            containerd does not list ``ref`` afterwards (the output's tail).
    """
    if ref in _image_names(ctr):
        return False
    repository = ref.rsplit(":", 1)[0]
    with tempfile.TemporaryDirectory(dir=builder.cache) as tmp:
        archive = builder.export(ref, Path(tmp) / "image.tar")
        try:
            out = builder.run("import", [*ctr, "images", "import", "--base-name", repository,
                                         str(archive)], timeout=timeout)
        except ImageBuildError:
            subprocess.run([*ctr, "images", "rm", ref], capture_output=True, check=False)
            raise
    listed = _image_names(ctr)
    if ref not in listed:
        raise ImageBuildError(f"import of {ref} named no such image (containerd lists "
                              f"{', '.join(listed) or 'nothing'}); ctr printed:\n{out[-2000:]}")
    return True
