"""Run a command under a parent that does not reap: the PID 1 of a container started
without `--init` (a shell entrypoint), which leaves a killed run a zombie.

    python tests/no_reaper.py [--wait] COMMAND...

The process makes itself the subreaper of everything it starts, so an orphan (a command
whose own parent died, as `timeout -s KILL` dies with its child) is reparented to it and not
to the machine's PID 1, which would reap it. It reaps nothing until its stdin closes; with
`--wait` it waits for COMMAND alone (not for the orphans) and prints `exit <code>`.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> None:
    wait = argv[:1] == ["--wait"]
    command = argv[1:] if wait else argv
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    child = subprocess.Popen(command)
    print(f"started {child.pid}", flush=True)
    if wait:
        _, status = os.waitpid(child.pid, 0)  # this child only: orphans stay zombies
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
    sys.stdin.read()  # until the test is done looking at the zombies
    child.returncode = 0  # reaped above or below, never by Popen's own bookkeeping
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


if __name__ == "__main__":
    main(sys.argv[1:])
