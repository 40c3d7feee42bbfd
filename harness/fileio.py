"""Atomic writes: a reader never sees a half-written results file."""

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def naming(path):
    """An OSError raised inside names `path`: a write or fsync on an open file (a full disk, say)
    raises one without a file name, and "No space left on device" alone does not say where."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror or str(e), str(path)) from e


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; results and reports are meant to be shared
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    with naming(path.parent):
        _sync_dir(path.parent)


def _sync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable: without it a power loss can bring back the old file."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def append_jsonl(path: Path, record: dict) -> None:
    """One complete line per call, flushed, so an interrupted run keeps every finished record.

    All or nothing: when the write fails (a full disk, a file-size limit), the file is cut back
    to where it was, so no half record is left for the next append to glue onto."""
    data = (json.dumps(record) + "\n").encode("utf-8")
    with naming(path):
        _append(path, data)


class BackgroundAppender:
    """append_jsonl on a thread of its own: for records made where a slow disk must not delay the
    caller (the open loop's sends). `close` waits for every record and raises the first failure."""

    def __init__(self, path: Path):
        import queue
        import threading

        self.path = path
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name="moebench-samples", daemon=True)
        self._thread.start()

    def append(self, record: dict) -> None:
        self._queue.put(record)

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            if self._error is None:
                try:
                    append_jsonl(self.path, record)
                except BaseException as e:  # handed to close(), on the caller's thread
                    self._error = e

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the original error says more than this one
            raise
    finally:
        os.close(fd)


def drop_torn_tail(path: Path) -> int:
    """Cut an append-only JSONL file back to its last complete record; returns the bytes dropped.

    A crash or power loss during an append can leave the file ending in part of a line (or in
    zeros). That line belongs to work that never finished, so it is dropped; a malformed line
    anywhere before the last stays an error for read_jsonl."""
    path = Path(path)
    with open(path, "r+b") as f:
        data = f.read()
        body = data.rstrip(b"\n")
        start = body.rfind(b"\n") + 1
        last = body[start:]
        if not last.strip():
            return 0
        try:
            json.loads(last)
        except (json.JSONDecodeError, UnicodeDecodeError):
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())
            return len(data) - start
        if not data.endswith(b"\n"):  # the record arrived whole, its newline did not
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        return 0


def ensure_writable_dir(path: Path, what: str) -> Path:
    """Create `path` if needed and prove that a file can be written in it, before any work starts:
    a read-only filesystem, a regular file in the way or a missing permission is then one clear
    line, not a traceback after the model has loaded."""
    from moebench.errors import MoebenchError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".moebench-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise MoebenchError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return path


def read_jsonl(path: Path) -> list[dict]:
    from moebench.errors import MoebenchError

    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:  # e.msg alone can end mid-sentence ("Invalid control character at")
                raise MoebenchError(f"{path}:{lineno}: malformed JSON line ({e.msg.removesuffix(' at')} at column {e.colno})") from None
    return records


def read_json(path: Path, missing: str = "missing"):
    """A JSON file's value; MoebenchError naming the file if it is absent or not JSON."""
    from moebench.errors import MoebenchError

    if not path.is_file():
        raise MoebenchError(f"{path}: {missing}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid JSON ({e})") from None
