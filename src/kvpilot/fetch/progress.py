"""Download progress for the pod log: one line per file started and one every
``interval`` seconds with the bytes so far, the share of the total, the rate and the time
left. Thread-safe (the S3 client reports from its download loop; the OCI pull is watched
from outside through the size of the file being written)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvpilot.fetch.files import human_bytes

REPORT_SECONDS = 5.0


class Progress:
    """Counts the bytes of a download of ``total_files`` files, ``total_bytes`` in all.

    Args:
        what: names the download in each line (``s3://bucket/prefix``).
        total_files / total_bytes: what will be fetched (bytes may be 0 when unknown).
        log: where lines go (``print`` with flush in the init container).
        interval: seconds between progress lines while bytes flow.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, what: str, total_files: int, total_bytes: int,
                 log: Callable[[str], None], interval: float = REPORT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total_files, self.total_bytes = what, total_files, total_bytes
        self.log, self.interval, self.clock = log, interval, clock
        self.done_bytes = 0
        self.file_index = 0
        self._lock = threading.Lock()
        self._start = clock()
        self._last_report = self._start

    def start_file(self, name: str, size: int) -> None:
        with self._lock:
            self.file_index += 1
            self.log(f"fetch {self.what}: [{self.file_index}/{self.total_files}] {name}"
                     f" ({human_bytes(size)})")

    def add(self, length: int) -> None:
        """``length`` more bytes arrived; logs a line when ``interval`` has passed."""
        with self._lock:
            self.done_bytes += length
            now = self.clock()
            if now - self._last_report >= self.interval:
                self._last_report = now
                self.log(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        rate = self.done_bytes / elapsed
        text = f"fetch {self.what}: {human_bytes(self.done_bytes)}"
        if self.total_bytes:
            share = min(1.0, self.done_bytes / self.total_bytes)
            text += f" of {human_bytes(self.total_bytes)} ({share:.0%})"
        text += f", {human_bytes(rate)}/s"
        if self.total_bytes and rate > 0:
            left = max(0.0, (self.total_bytes - self.done_bytes) / rate)
            text += f", {left:.0f} s left"
        return text

    def finish(self) -> None:
        elapsed = self.clock() - self._start
        self.log(f"fetch {self.what}: done, {self.total_files} files,"
                 f" {human_bytes(self.done_bytes)} in {elapsed:.1f} s")

    # The S3 client's progress protocol (minio's ProgressType).
    def set_meta(self, object_name: str, total_length: int) -> None:
        """Called by the S3 client when an object's body starts; nothing to do (the file
        was announced by :meth:`start_file`)."""

    def update(self, length: int) -> None:
        self.add(length)


class FileWatcher:
    """Reports the growth of a file being written by code that reports nothing (the OCI
    blob download) to ``progress``, from a thread, every ``interval`` seconds, until
    :meth:`stop`. The final size is added by :meth:`stop`."""

    def __init__(self, progress: Progress, path: Path, interval: float = 1.0) -> None:
        self.progress, self.path, self.interval = progress, path, interval
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._advance()

    def _advance(self) -> None:
        size = self._size()
        if size > self._seen:
            self.progress.add(size - self._seen)
            self._seen = size

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._advance()
