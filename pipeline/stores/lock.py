"""One writer at a time: a leased lock file created atomically inside the store.

`<store>/_bertpipe.lock` holds who took it (host, pid, process start time, job fingerprint),
a random `token` naming this acquisition and a `generation` counting take-overs. It is
created only if absent and whole: locally a hard link of a fully written temporary file,
on an object store a conditional PUT (`If-None-Match: *` on S3, which fails with 412 when
the key exists), so a reader never sees it half written and two runs never both hold it.

The lock is a lease. Its holder refreshes it every `refresh_s` seconds (locally its
modification time, on an object store its `refreshed_unix` field, rewritten after checking
the token is still its own); `refresh_s` is written in the record, so every reader judges
a lock by its holder's own interval. A lock is taken over by the next run, which logs it
and records it in the store's history, when its holder is provably gone:

- same host, and the holder's pid is gone, a zombie or exiting (a process killed with
  SIGKILL is a zombie until its parent reaps it, forever under a PID 1 that does not reap)
  or now names another process (its start time differs: a reused pid does not fool it), or
- any host, local disk or object store: the lease expired, `LEASE_BEATS` refresh intervals
  without a refresh (a holder killed on another node, or paused: SIGSTOP, a frozen VM).

A lock that has missed `SUSPECT_BEATS` refreshes is waited on until its lease ends (at
most `(LEASE_BEATS - SUSPECT_BEATS) * refresh_s`), so a retry that starts soon after its
predecessor died still resumes on its own. A live lock is never taken over. Two runs that
find the same dead lock race through a claim file created if absent (`_bertpipe.lock.
takeover-<token>`): exactly one of them replaces the lock.

Fencing: a holder that was paused past its lease and wakes up must not write or delete
anything. Every step that publishes (a staged part, the commit, removing a store) first
checks that the lock still carries its token (`Fence.check`, `StoreLock.confirm`) and
refuses otherwise (exit 5); the holder's refresher stops touching a lock that is no longer
its own. What cannot be proven (an unreadable lock, a fresh lock of another host) is
reported with the command that clears it, `bertpipe unlock STORE`.

Hosts sharing a store must keep their clocks within a small fraction of the lease (NTP):
the age of an object-store lock is read from the time its holder wrote into it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import OptionError, StoreError
from ..io.location import Location, resolve

log = logging.getLogger(__name__)

LOCK_NAME = "_bertpipe.lock"
TAKEOVER_PREFIX = f"{LOCK_NAME}.takeover-"
NOT_A_LOCK_FILE = "is a directory, not a lock file bertpipe wrote"
# How often a holder refreshes its lock; `BERTPIPE_LOCK_REFRESH_S` changes it (tests use
# fractions of a second). Why 30 s: a refresh costs one small write, and the lease it gives
# (2.5 min) is short beside a scheduler's retry back-off.
DEFAULT_REFRESH_S = 30.0
REFRESH_ENV = "BERTPIPE_LOCK_REFRESH_S"
# A lock not refreshed for LEASE_BEATS intervals has expired: its holder is dead or frozen.
# Why 5: one or two missed beats happen to a healthy run on a loaded machine (a long GC, a
# slow object store); five do not.
LEASE_BEATS = 5
# A lock that has missed this many beats is waited on until its lease ends.
SUSPECT_BEATS = 2
# Locks written before leases had no `refresh_s`; their holders refreshed every 60 s.
LEGACY_REFRESH_S = 60.0
# The intervals a run may choose. Below 0.05 s the refresher would spin and a loaded machine
# would miss beats; above an hour a killed run's lock would keep its store for most of a
# night. A lock is judged by beats of at least JUDGED_BEAT_S, whatever its record says, so no
# record (however written) makes a healthy run's lease shorter than a second.
MIN_REFRESH_S, MAX_REFRESH_S = 0.05, 3600.0
JUDGED_BEAT_S = 0.2


def refresh_interval() -> float:
    """This process's refresh interval: the environment's, else the default; a value that
    is not a positive number of seconds is refused (never silently replaced)."""
    raw = os.environ.get(REFRESH_ENV, "").strip()
    if not raw:
        return DEFAULT_REFRESH_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise OptionError(f"{REFRESH_ENV}: {raw!r} is not a positive number of seconds "
                          f"(the lock's refresh interval; unset it for {DEFAULT_REFRESH_S:g})")
    if not MIN_REFRESH_S <= value <= MAX_REFRESH_S:
        raise OptionError(f"{REFRESH_ENV}: {raw!r} is out of range: the lock's refresh "
                          f"interval is {MIN_REFRESH_S:g} to {MAX_REFRESH_S:g} seconds (unset "
                          f"it for {DEFAULT_REFRESH_S:g})")
    return value


@dataclass(frozen=True)
class LockState:
    """What a run may do about the lock it found: `free`, `live` (refuse), `suspect` (wait
    `wait_s` for its lease to end), `dead` (take it over, `reason` says why) or
    `unknown` (unreadable: refuse, naming `bertpipe unlock`)."""

    kind: str
    holder: dict[str, Any]
    reason: str = ""
    wait_s: float = 0.0


class StoreLock:
    def __init__(self, store_path: str | Path | Location,
                 say: Callable[[str], None] = log.warning, command: str | None = None):
        """`command`: the command that takes the lock when it is not a run (`gc`): its
        refusals then name the store itself and that command, not the job's output.path."""
        self.store = store_path if isinstance(store_path, Location) else resolve(store_path)
        self.named = f"{self.store}" if command else f"output.path: {self.store}"
        self.instead = (f"then run {command} again" if command else
                        "or choose another output.path")
        self.file = self.store.child(LOCK_NAME)
        self.refresh_s = refresh_interval()  # read now: a bad value refuses before any write
        self.token: str | None = None  # set while this object holds the lock
        self.took_over: str = ""  # whose lock this run took over, and why ("" if none)
        self.lost = False  # set by the refresher when another run took the lock over
        self._stop = threading.Event()
        self._holder: dict[str, Any] = {}
        self._claims: list[Location] = []
        self._refresher: threading.Thread | None = None
        self._say = say  # the one line that says a lock was taken over or waited on

    @property
    def path(self) -> Path:
        """The lock file of a local store."""
        return Path(self.file.path)

    # --- taking and giving back -------------------------------------------------------

    def acquire(self, fingerprint: str) -> None:
        """Take the lock: create it, take over a dead holder's, or wait out a suspect one's
        lease; raise StoreError naming a live holder (or how to clear an unknown one)."""
        record = self._record(fingerprint)
        for _ in range(100):  # each pass ends or observes another run's lock change
            if self.file.create_exclusive(_dump(record)):
                return self._hold(record)
            state = self.state()
            if state.kind == "free":
                continue  # released between our attempt and the read: try again
            if state.kind == "dead":
                return self._take_over(record, state)
            if state.kind == "suspect":
                self._say(f"{self.store}: the lock of {describe(state.holder)} was not "
                          f"refreshed for {self.idle_seconds(state.holder):.0f} s; waiting up "
                          f"to {state.wait_s:.0f} s for its lease to end")
                time.sleep(min(state.wait_s, _refresh_of(state.holder)) + 0.01)
                continue
            raise StoreError(self.refusal(state))
        raise StoreError(f"{self.named}: the lock kept changing hands; try again")

    def _record(self, fingerprint: str) -> dict[str, Any]:
        now = time.time()
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "process_start": _process_start(os.getpid()),
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
                "started_unix": now, "refreshed_unix": now, "refresh_s": self.refresh_s,
                "fingerprint": fingerprint, "token": uuid.uuid4().hex, "generation": 1}

    def _hold(self, record: dict[str, Any]) -> None:
        self.token = record["token"]
        self._holder = record
        self.lost = False
        self._stop.clear()
        self._refresher = threading.Thread(target=self._heartbeat, name="bertpipe-lock",
                                           daemon=True)
        self._refresher.start()

    def _take_over(self, record: dict[str, Any], state: LockState) -> None:
        """Replace a dead holder's lock. The claim file (created if absent, one per dead
        token) lets exactly one of several runs that found the same dead lock replace it."""
        dead = state.holder
        claim = self._claim_of(dead)
        if not claim.create_exclusive(_dump(record)):
            raise StoreError(self._being_taken_over(state))
        if _token_of(self.holder() or {}) != _token_of(dead):  # it changed since we read it
            claim.remove()
            raise StoreError(f"{self.named}: its lock changed hands while this run "
                             "took it over; try again")
        self.took_over = f"the lock of {describe(dead)}: {state.reason}"
        record = {**record, "generation": int(dead.get("generation", 0) or 0) + 1,
                  "took_over": {k: dead.get(k) for k in ("host", "pid", "started", "token")}
                  | {"reason": state.reason}}
        self.file.write_bytes(_dump(record))
        self._claims.append(claim)
        self._say(f"{self.store}: took over {self.took_over}")
        self._hold(record)

    def _claim_of(self, dead: dict[str, Any]) -> Location:
        return self.store.child(TAKEOVER_PREFIX + _token_of(dead))

    def _being_taken_over(self, state: LockState) -> str:
        return (f"{self.named} is being taken over by another run (the lock of "
                f"{describe(state.holder)} {state.reason}); wait for it to finish")

    def check_free_to_take(self) -> None:
        """Raise the StoreError `acquire` would raise now, writing nothing: a live or
        unreadable lock, or a dead one another run is taking over."""
        state = self.state()
        if state.kind in ("live", "unknown"):
            raise StoreError(self.refusal(state))
        if state.kind == "dead" and self._claim_of(state.holder).exists():
            raise StoreError(self._being_taken_over(state))

    def _heartbeat(self) -> None:
        token = self.token
        while not self._stop.wait(self.refresh_s):
            if self.token != token:
                return  # released
            if _token_of(self.holder() or {}) != token:
                self.lost = True  # taken over or cleared: never touch another's lock
                return
            with contextlib.suppress(Exception):  # a missed beat is retried on the next
                self._refresh()

    def _refresh(self) -> None:
        if self.file.local:
            os.utime(self.file.path)
            return
        # no mtime to touch on an object store: the holder rewrites its own record
        self._holder = {**self._holder, "refreshed_unix": time.time()}
        self.file.write_bytes(_dump(self._holder))

    def release(self) -> None:
        """Remove the lock if it is still this object's (never another run's)."""
        self._stop.set()
        if self._refresher is not None:  # a refresh in flight would write the lock anew
            self._refresher.join(timeout=60)
            self._refresher = None
        if self.token is None:
            return
        if _token_of(self.holder() or {}) == self.token:
            self.file.remove()
            for claim in self._claims:  # after the lock: a claim outlives what it guards
                claim.remove()
        self.token = None
        self._claims = []

    # --- fencing ----------------------------------------------------------------------

    def fence(self) -> Fence | None:
        """What a writer (in this process or on a worker) checks before it publishes."""
        return Fence(self.file, self.token) if self.token else None

    def confirm(self, action: str) -> None:
        """Raise StoreError unless this object still holds the lock: a run that was paused
        past its lease and taken over must not `action` (commit, remove) anything."""
        fence = self.fence()
        if fence is None:
            raise StoreError(f"{self.named}: this run does not hold the lock; "
                             f"it will not {action}")
        fence.check(action)

    # --- reading ----------------------------------------------------------------------

    def holder(self) -> dict[str, Any] | None:
        """Who holds the lock, or None when there is none ({} when unreadable)."""
        return read_record(self.file)

    def idle_seconds(self, holder: dict[str, Any]) -> float:
        """Time since the holder last refreshed the lock."""
        if self.file.local:
            try:
                return time.time() - os.stat(self.file.path).st_mtime
            except FileNotFoundError:
                return 0.0
        refreshed = holder.get("refreshed_unix", holder.get("started_unix"))
        return time.time() - float(refreshed) if isinstance(refreshed, (int, float)) else 0.0

    def state(self) -> LockState:
        """What the lock on the store is, for a run that wants it."""
        if self.file.local and os.path.isdir(self.file.path):
            return LockState("unknown", {}, NOT_A_LOCK_FILE)
        holder = self.holder()
        if holder is None:
            return LockState("free", {})
        if not holder:
            return LockState("unknown", holder, "the lock file is unreadable")
        refresh = _refresh_of(holder)
        idle = self.idle_seconds(holder)
        if idle > LEASE_BEATS * refresh:
            return LockState("dead", holder, f"its lease expired (not refreshed for "
                             f"{_duration(idle)}, lease {_duration(LEASE_BEATS * refresh)})")
        if holder.get("host") == socket.gethostname() and not _alive(holder):
            return LockState("dead", holder, f"process {holder.get('pid')} is no longer "
                             "running on this host")
        if idle > SUSPECT_BEATS * refresh:
            return LockState("suspect", holder, wait_s=LEASE_BEATS * refresh - idle)
        return LockState("live", holder)

    def live_here(self, holder: dict[str, Any]) -> bool:
        """The holder is a running process on this host (the one lock `unlock` refuses)."""
        return holder.get("host") == socket.gethostname() and _alive(holder)

    def refusal(self, state: LockState | None = None) -> str:
        state = state or self.state()
        if state.kind == "free":  # released between our attempt and this read
            return f"{self.named} was locked by another run; try again"
        if state.reason == NOT_A_LOCK_FILE:
            return (f"{self.named}: {LOCK_NAME} {NOT_A_LOCK_FILE}; nothing was "
                    "changed: move it out of the store and run again")
        if state.kind == "unknown":
            return (f"{self.named} is locked, but {state.reason}; if no run is "
                    f"writing to it, clear the lock with `bertpipe unlock {self.store}` and "
                    "run again")
        return (f"{self.named} is being written by another run "
                f"({describe(state.holder)}); wait for it to finish, {self.instead}")

    def force_remove(self) -> None:
        """Remove the lock file; a folder in its place is not ours to remove."""
        if self.file.local and os.path.isdir(self.file.path):
            raise StoreError(f"{self.store}: {LOCK_NAME} {NOT_A_LOCK_FILE}; nothing was "
                             "removed: move it out of the store yourself")
        self.file.remove()


class LockLostError(StoreError):
    """This run's lock was taken over while it was paused: it must stop writing."""


@dataclass(frozen=True)
class Fence:
    """The lock file and the token a run holds it with; picklable, so Dask workers check
    it before they publish a part."""

    lock_file: Location
    token: str

    def check(self, action: str) -> None:
        holder = read_record(self.lock_file)
        if _token_of(holder or {}) == self.token:
            return
        now = (f"now held by {describe(holder)}" if holder else
               "released by the run that took it over")
        raise LockLostError(f"output.path: {self.lock_file.url.rsplit('/', 1)[0]}: this run's "
                         f"lock was taken over by another run after its lease expired ({now}); "
                         f"this run will not {action}: nothing of the other run's is touched")


def read_record(file: Location) -> dict[str, Any] | None:
    """A lock file's record, None when absent, {} when unreadable."""
    for _ in range(20):  # a lock made by the O_EXCL fallback may be read half written
        try:
            text = file.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:  # a folder in its place, no permission: there, but not readable
            return {}
        try:
            value = json.loads(text)
            return value if isinstance(value, dict) else {}
        except ValueError:
            time.sleep(0.05)
    return {}


def describe(holder: dict[str, Any]) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
            f"{holder.get('started', '?')}, job {str(holder.get('fingerprint', '?'))[:12]}")


def _dump(record: dict[str, Any]) -> bytes:
    return json.dumps(record, indent=1).encode()


def _token_of(holder: dict[str, Any]) -> str:
    """The holder's token; a record without one is named by its content's digest."""
    token = holder.get("token")
    if isinstance(token, str) and token:
        return token
    return hashlib.sha256(json.dumps(holder, sort_keys=True).encode()).hexdigest()[:32]


def _refresh_of(holder: dict[str, Any]) -> float:
    """The interval a lock is judged by: its holder's, held within the bounds a run may
    choose (a record written by hand or by another version cannot make a lease endless or
    shorter than a second)."""
    value = holder.get("refresh_s", LEGACY_REFRESH_S)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not math.isfinite(value) or value <= 0:
        return LEGACY_REFRESH_S
    return min(max(float(value), JUDGED_BEAT_S), MAX_REFRESH_S)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _alive(holder: dict[str, Any]) -> bool:
    """The holder's process still runs: its pid names a process that is neither a zombie nor
    exiting (a process killed with SIGKILL stays a zombie until its parent reaps it, forever
    under a PID 1 that does not reap, and holds nothing), started when the lock says (a reused
    pid does not fool it). A lock without a start time is believed only while its pid runs a
    Python or bertpipe program: pid 1 of a host is not a run of ours."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive unless /proc says otherwise
    stat = _proc_stat(pid)
    if stat is None:  # no /proc (not Linux) or gone since: the signal is all we know
        return True
    if stat.state in _NOT_RUNNING or stat.flags & _PF_EXITING:
        return False
    recorded = holder.get("process_start")
    if recorded is None:
        return any(name in stat.command.lower() for name in ("python", "bertpipe"))
    return stat.start == recorded


# /proc/<pid>/stat states of a process that will never run again: zombie, dead
_NOT_RUNNING = frozenset("ZXx")
_PF_EXITING = 0x4  # include/linux/sched.h: the process is in exit()


@dataclass(frozen=True)
class _ProcStat:
    command: str  # the executable's name, as the kernel keeps it (15 characters at most)
    state: str
    flags: int
    start: str  # clock ticks since boot


def _proc_stat(pid: int) -> _ProcStat | None:
    """The fields of /proc/<pid>/stat this module needs, None where there is no such file."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    command = stat[stat.find("(") + 1:stat.rfind(")")]
    fields = stat.rsplit(")", 1)[-1].split()  # fields 3.. (the name may hold spaces)
    return _ProcStat(command=command, state=fields[0], flags=int(fields[6]), start=fields[19])


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid."""
    stat = _proc_stat(pid)
    return stat.start if stat else None
