"""One writer at a time: a lock file created atomically inside the store.

`<store>/_bertpipe.lock` holds who took it (host, pid, start time, job fingerprint). It is
created only if absent and whole: locally a hard link of a fully written temporary file,
on an object store a conditional PUT (`If-None-Match: *` on S3, which fails with 412 when
the key exists), so a reader never sees it half written and two runs never both hold it;
`acquire` and `release` are all a run needs. While held it is refreshed every
`HEARTBEAT_S` (locally its modification time, on an object store its `refreshed_unix`
field, rewritten by the holder after checking the token is still its own), so a run of any
length keeps it fresh. A lock is never taken over automatically: one whose holder is dead
(on this host), or that was not refreshed for `STALE_AFTER_S` (any host), is reported with
the command that clears it (`bertpipe unlock STORE`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .fs import Location, resolve

LOCK_NAME = "_bertpipe.lock"
HEARTBEAT_S = 60.0
# Not refreshed for this long, a lock is reported as stale even when its holder cannot be
# checked (another host): its holder died or was suspended. Generous, for clock skew
# between hosts on a shared file system.
STALE_AFTER_S = 3600


class StoreLock:
    def __init__(self, store_path: str | Path | Location):
        self.store = store_path if isinstance(store_path, Location) else resolve(store_path)
        self.file = self.store.child(LOCK_NAME)
        self.token: str | None = None  # set while this object holds the lock
        self._stop = threading.Event()
        self._holder: dict[str, Any] = {}

    @property
    def path(self) -> Path:
        """The lock file of a local store."""
        return Path(self.file.path)

    def acquire(self, fingerprint: str) -> None:
        """Take the lock, or raise StoreError naming the holder (and how to clear a stale one)."""
        token = uuid.uuid4().hex
        now = time.time()
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "process_start": _process_start(os.getpid()),
                  "started": datetime.now(UTC).isoformat(timespec="seconds"),
                  "started_unix": now, "refreshed_unix": now, "fingerprint": fingerprint,
                  "token": token}
        if not self.file.create_exclusive(json.dumps(holder, indent=1).encode()):
            raise StoreError(self.refusal())
        self.token = token
        self._holder = holder
        self._stop.clear()
        threading.Thread(target=self._heartbeat, name="bertpipe-lock", daemon=True).start()

    def _heartbeat(self) -> None:
        token = self.token
        while not self._stop.wait(HEARTBEAT_S):
            if self.token != token or (self.holder() or {}).get("token") != token:
                return  # released, or cleared by `bertpipe unlock`: never touch another's
            with contextlib.suppress(Exception):  # a missed beat is retried on the next
                self._refresh()

    def _refresh(self) -> None:
        if self.file.local:
            os.utime(self.file.path)
            return
        # no mtime to touch on an object store: the holder rewrites its own record
        self._holder = {**self._holder, "refreshed_unix": time.time()}
        self.file.write_bytes(json.dumps(self._holder, indent=1).encode())

    def release(self) -> None:
        """Remove the lock if it is still this object's (never another run's)."""
        self._stop.set()
        if self.token is None:
            return
        if (self.holder() or {}).get("token") == self.token:
            self.file.remove()
        self.token = None

    def holder(self) -> dict[str, Any] | None:
        """Who holds the lock, or None when there is none."""
        for _ in range(20):  # a lock made by the O_EXCL fallback may be read half written
            try:
                text = self.file.read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                value = json.loads(text)
                return value if isinstance(value, dict) else {}
            except ValueError:
                time.sleep(0.05)
        return {}

    def idle_seconds(self, holder: dict[str, Any]) -> float:
        """Time since the holder last refreshed the lock."""
        if self.file.local:
            try:
                return time.time() - os.stat(self.file.path).st_mtime
            except FileNotFoundError:
                return 0.0
        refreshed = holder.get("refreshed_unix", holder.get("started_unix"))
        return time.time() - float(refreshed) if isinstance(refreshed, (int, float)) else 0.0

    def stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why the holder cannot still be running, or None when it may be."""
        if not holder:
            return "the lock file is unreadable"
        idle = self.idle_seconds(holder)
        if idle > STALE_AFTER_S:
            return f"not refreshed for {idle / 3600:.1f} h"
        if holder.get("host") == socket.gethostname() and not _alive(holder):
            return f"process {holder.get('pid')} is no longer running on this host"
        return None

    def live_here(self, holder: dict[str, Any]) -> bool:
        """The holder is a running process on this host (the one lock `unlock` refuses)."""
        return holder.get("host") == socket.gethostname() and _alive(holder)

    def refusal(self) -> str:
        holder = self.holder()
        if holder is None:  # released between our attempt and this read: say so plainly
            return f"output.path: {self.store} was locked by another run; try again"
        who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
               f"{holder.get('started', '?')}, job {str(holder.get('fingerprint', '?'))[:12]}")
        stale = self.stale_reason(holder)
        if stale:
            return (f"output.path: {self.store} is locked by a run that looks stale ({who}; "
                    f"{stale}); if no run is writing to it, clear the lock with "
                    f"`bertpipe unlock {self.store}` and run again")
        return (f"output.path: {self.store} is being written by another run ({who}); wait for "
                "it to finish, or choose another output.path")

    def force_remove(self) -> None:
        self.file.remove()


def _alive(holder: dict[str, Any]) -> bool:
    """The holder's process still runs (same pid and, where /proc tells, same start time)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    recorded = holder.get("process_start")
    return recorded is None or _process_start(pid) in (None, recorded)


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command name
