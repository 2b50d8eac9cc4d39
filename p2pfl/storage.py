"""Durable writes to a run folder: never a torn file, and a storage fault retried, then one line.

Every file a run writes goes through here (checkpoints, ``metrics*.jsonl``, the inputs, the
summary, ``config-changes.jsonl``, the push-sum ledger's log):

* `atomic_write`: the whole file to a temporary name in the same folder, flushed and fsynced
  (``durable``), then ``os.replace``d over the target (and the folder fsynced): a reader sees the
  old file or the new one, never a part of either. A failed write removes its temporary file.
* `JsonlLog`: one writer's append-only JSON-lines file. A record is one ``os.write`` of the whole
  line at the end of what was last written whole; a write cut short (a full disk) is cut off
  again before the retry, and a tail torn by a kill is cut off when the file is opened, so a line
  is either all there or not there. `append_line`: an occasional append by several processes (one
  ``O_APPEND`` write, on a fresh line). `read_jsonl` skips a line that does not parse.
* `retrying`: a write that fails for lack of storage -- no space (``ENOSPC``, ``EDQUOT``), a
  read-only file system (``EROFS``), no permission (``EACCES``, ``EPERM``), an I/O error (``EIO``)
  -- is retried with exponential backoff (0.1 s doubling up to 5 s), one log line per failure, no
  traceback, for at most the budget (`configure`; ``checkpoint.storage_retry_s``, default 60 s,
  the default ``network.round_timeout_s``: the neighbours wait that long for this peer's next
  payload). Past the budget it raises `StorageError` (``PATH: problem``): ``p2pfl node`` prints
  ``error: PATH: problem`` and exits with `EXIT_STORAGE` (74, ``EX_IOERR`` of sysexits.h), the
  run folder as resumable as after a kill. Any other ``OSError`` is not a storage fault and is
  raised as it is.

Test hook (docs/bad-input.md, "Storage"): when the environment variable ``P2PFL_FAULT_STORAGE``
names a file, every write here first reads it; while it exists and holds an errno name
(``ENOSPC``, ``EROFS``, ``EIO``, ...) the write fails with that error, as the device would: an
``ENOSPC`` or ``EIO`` after writing part of the data (half a line, a temporary file half written),
the others before writing anything. Unset (the default), nothing is read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

__all__ = ["DEFAULT_RETRY_S", "EXIT_STORAGE", "FAULT_ENV", "STORAGE_ERRNOS", "JsonlLog", "StorageError",
           "append_line", "atomic_write", "configure", "read_jsonl", "retry_budget", "retrying"]

log = logging.getLogger(__name__)

#: ``p2pfl node`` exits with this when a storage fault outlasted the retry budget (sysexits EX_IOERR).
EXIT_STORAGE = 74
#: Errors that say the storage, not the program, is at fault: retried, then `StorageError`.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})
#: Seconds a failed write is retried for (the default ``network.round_timeout_s``).
DEFAULT_RETRY_S = 60.0
#: The test hook's environment variable (see the module's docstring).
FAULT_ENV = "P2PFL_FAULT_STORAGE"

_FIRST_WAIT_S, _MAX_WAIT_S = 0.1, 5.0
_budget_s = DEFAULT_RETRY_S

T = TypeVar("T")


class StorageError(RuntimeError):
    """A write the storage refused for longer than the retry budget: ``str()`` is ``PATH: problem``."""

    exit_code = EXIT_STORAGE

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def configure(retry_s: float) -> None:
    """This process's retry budget in seconds (0: fail at the first storage fault)."""
    global _budget_s
    _budget_s = max(0.0, float(retry_s))


def retry_budget() -> float:
    return _budget_s


def _problem(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))


def retrying(path: str | os.PathLike[str], fn: Callable[[], T], what: str = "write",
             budget_s: float | None = None) -> T:
    """``fn()``, retried while it fails with a storage error (`STORAGE_ERRNOS`) for at most
    ``budget_s`` (default: `configure`'s), with exponential backoff; one warning per failure.
    Past the budget: `StorageError`. ``fn`` must be safe to repeat (each helper here is)."""
    budget = _budget_s if budget_s is None else budget_s
    t0 = time.monotonic()
    wait = _FIRST_WAIT_S
    failures = 0
    while True:
        try:
            return fn()
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                raise
            failures += 1
            left = budget - (time.monotonic() - t0)
            if left <= 0:
                raise StorageError(path, f"cannot {what}: {_problem(exc)} (gave up after {failures} "
                                         f"attempt{'s' if failures > 1 else ''} in {budget:g} s)") from None
            pause = min(wait, left)
            log.warning("storage: %s: cannot %s: %s; retrying in %.1f s (%.1f s of %g s left)", path, what,
                        _problem(exc), pause, left, budget)
            time.sleep(pause)
            wait = min(wait * 2, _MAX_WAIT_S)


# -- the test hook ----------------------------------------------------------------------------------
def _injected() -> int | None:
    """The errno the test hook injects now, or None (hook unset, or its file absent)."""
    ctl = os.environ.get(FAULT_ENV)
    if not ctl:
        return None
    try:
        name = Path(ctl).read_text().strip()
    except OSError:
        return None
    return getattr(errno, name, errno.EIO) if name else None


def _fail(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _check_fault(path: Path, partial: bool) -> int | None:
    """Raise the injected error now if it strikes before any byte is written; return it when it
    strikes after part of the data (``partial``: ENOSPC, EIO), for the caller to raise there."""
    code = _injected()
    if code is None:
        return None
    if partial and code in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
        return code
    raise _fail(code, path)


# -- whole files ------------------------------------------------------------------------------------
def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without directory fds: the rename is as durable as it gets
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in STORAGE_ERRNOS:
            raise
    finally:
        os.close(fd)


def _write_once(path: Path, data: bytes | Callable[[IO[bytes]], Any], durable: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    late = _check_fault(path, partial=True)
    try:
        with open(tmp, "wb") as f:
            if late is not None:  # the injected fault strikes halfway through the file
                f.write(data[: len(data) // 2] if isinstance(data, bytes) else b"PK\x03\x04 cut short")
                raise _fail(late, path)
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only folder: there is no temporary file either
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike[str], data: str | bytes | Callable[[IO[bytes]], Any], *,
                 durable: bool = True, retry: bool = True) -> None:
    """Replace ``path`` whole with ``data`` (text, bytes, or a function writing to a binary file).

    ``durable``: fsync the file before the rename and the folder after, so it survives a power
    loss, not only a kill; ``retry``: storage errors retried (`retrying`), else raised at once.
    Several processes may write the same path at once: each replaces it whole (unique temporary names).
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data

    def once() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_once(path, payload, durable)

    if retry:
        retrying(path, once)
    else:
        once()


# -- JSON lines ---------------------------------------------------------------------------------------
def _cut_torn_tail(fd: int) -> int:
    """Truncate an open file after its last newline (a line torn by a kill); return the new size."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    end = size
    step = 4096
    while end > 0:
        start = max(0, end - step)
        chunk = os.pread(fd, end - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            keep = start + nl + 1
            break
        end = start
    else:
        keep = 0
    if keep != size:
        os.ftruncate(fd, keep)
    return keep


class JsonlLog:
    """This process's append-only JSON-lines file (one writer; thread-safe): whole lines only.

    Opening it cuts a torn tail (``truncate``: empties it); each `append` writes one line at the
    end of the last whole one, retried on a storage fault (`retrying`). ``durable``: fsync each
    line (the metrics are not: the checkpoint carries the round's record, docs/protocol.md).
    """

    def __init__(self, path: str | os.PathLike[str], *, truncate: bool = False, durable: bool = False) -> None:
        self.path = Path(path)
        self.durable = durable
        self._lock = threading.Lock()
        self._fd: int | None = None

        def open_() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if truncate else 0), 0o644)
            try:
                self._size = _cut_torn_tail(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd

        retrying(self.path, open_, "open")

    @property
    def closed(self) -> bool:
        return self._fd is None

    def _append_once(self, data: bytes) -> None:
        fd = self._fd
        assert fd is not None, f"{self.path} is closed"
        if os.fstat(fd).st_size != self._size:
            os.ftruncate(fd, self._size)  # a write cut short before: its part goes
        late = _check_fault(self.path, partial=True)
        if late is not None:
            os.pwrite(fd, data[: len(data) // 2], self._size)
            raise _fail(late, self.path)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], self._size + done)
        if self.durable:
            os.fsync(fd)
        self._size += len(data)

    def append(self, rec: dict[str, Any]) -> None:
        data = (json.dumps(rec, sort_keys=True) + "\n").encode()
        with self._lock:
            retrying(self.path, lambda: self._append_once(data), "append to")

    __call__ = append

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    if os.fstat(fd).st_size != self._size:
                        os.ftruncate(fd, self._size)  # a write that gave up leaves no part of a line
                except OSError:
                    pass  # readers skip a torn tail anyway (read_jsonl)
                os.close(fd)


def append_line(path: str | os.PathLike[str], line: str, *, durable: bool = True, retry: bool = True) -> None:
    """Append one line to a file several processes may append to (one ``O_APPEND`` write; a line
    after a torn one starts on a fresh line, so only the torn one is lost)."""
    path = Path(path)
    text = line.rstrip("\n") + "\n"

    def once() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_fault(path, partial=False)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
            os.write(fd, (("\n" if torn else "") + text).encode())
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    if retry:
        retrying(path, once, "append to")
    else:
        once()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, in order; a line that does not parse (torn) is skipped."""
    out: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
