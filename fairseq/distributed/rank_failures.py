"""Which spawned rank failed first, and how: the launcher's message when a job of spawned processes fails.

A rank that raises (or calls sys.exit with a non-zero status) writes a report stamped with the time, saying
which of its peers had already ended (read from /proc, by the pids the launcher wrote); a process killed by a
signal writes none and is placed by those reports, or else by when the launcher saw it end.
fairseq.distributed.launch writes the pids, watches the processes and raises the message.
"""

import json
import os
import signal
import sys
import time
import traceback
from typing import List, Optional, Tuple

from fairseq.runtime.env import LaunchPlan
from fairseq.runtime.errors import UserError


# Written by the launcher once the processes are started: {rank: pid} of every spawned process, so that a
# rank that fails can tell which of its peers had already ended (see `ended_peers`).
PIDS_FILE = "pids.json"


_PF_EXITING = 0x4  # Linux's per-task flag "getting shut down", set as a process starts to die (sched.h)


def process_ended(pid: int) -> Optional[bool]:
    """Whether process `pid` has ended or is ending (dying, a zombie not yet reaped, or gone); None where
    /proc cannot tell.

    "Ending" counts: a process killed by a signal closes its sockets (which is how its peers fail) only
    after its main thread has taken the exit path, flagged PF_EXITING; becoming a zombie comes later, and
    the dying process may be descheduled in between on a busy machine."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name, in parentheses, may hold spaces; then: state ppid pgrp session tty tpgid flags
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True  # already reaped by the launcher
    except OSError:
        return None
    try:
        state, flags = fields[0], int(fields[6])
    except (IndexError, ValueError):
        return None
    return state in ("Z", "X", "x") or bool(flags & _PF_EXITING)


def ended_peers(report_dir: str, rank: int) -> Optional[List[int]]:
    """Ranks of the other spawned processes that have ended by now; None if that cannot be told."""
    try:
        with open(os.path.join(report_dir, PIDS_FILE)) as f:
            pids = {int(r): int(pid) for r, pid in json.load(f).items()}
    except (OSError, ValueError):
        return None
    ended = []
    for peer, pid in sorted(pids.items()):
        if peer == rank:
            continue
        state = process_ended(pid)
        if state is None:
            return None
        if state:
            ended.append(peer)
    return ended


def write_failure_report(report_dir: str, rank: int, how: str = "failed", with_traceback: bool = True) -> None:
    """Leave word of this rank's failure, stamped with the time, for the launcher (call inside `except`).

    `how` completes "rank R of W ..." in the launcher's message ("failed", "exited with status 7"); the
    traceback of the exception being handled goes with it unless `with_traceback` is False. The report also
    names the peers that had already ended: a peer killed by a signal leaves no report, and this rank's
    failure may be the consequence of its death, noticed by the launcher only later."""
    peers_ended = ended_peers(report_dir, rank)  # looked at before the time stamp: they ended before it
    error = user_error_line() if with_traceback else None
    report = {
        "rank": rank,
        "time_ns": time.time_ns(),
        "how": how,
        "ended_peers": peers_ended,
        "error": error,
        "traceback": traceback.format_exc() if with_traceback and error is None else None,
    }
    path = os.path.join(report_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def user_error_line() -> Optional[str]:
    """The exception being handled as one line if it is a UserError (a full disk, a damaged checkpoint), told as
    fairseq-train tells it in one process, without a traceback."""
    err = sys.exc_info()[1]
    if not isinstance(err, UserError):
        return None
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def read_failure_reports(report_dir: str) -> List[dict]:
    """Reports of the ranks that failed, earliest first."""
    reports = []
    for name in os.listdir(report_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(report_dir, name)) as f:
                reports.append(json.load(f))
    return sorted(reports, key=lambda report: report["time_ns"])


# Only where a report cannot say which peers had ended (no /proc): the launcher notices a death a little
# after it happens (it must be woken and scheduled; up to 12 ms seen on a busy 2-core machine), while a
# report is stamped by the failing rank itself, so a death is taken to have happened this long before it
# was noticed.
DEATH_NOTICE_SLACK_NS = 50_000_000


def how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"{-exitcode} (unknown)"
        return f"was killed by signal {name}"
    return f"exited with status {exitcode}"


def failure_events(watch, reports: List[dict], first_rank: int) -> List[Tuple[int, int, dict]]:
    """(time_ns, rank, report) of every failure, in the order they happened; `watch`: the launcher's view of its
    processes (their `processes`, when it saw each end, `ended_ns`, and the ones it `stopped`).

    A report is stamped by its rank. A process that ended non-zero without a report (killed by a signal,
    os._exit) gets a report here, timed by the reports that say whether it had ended when they were written,
    or else by when the launcher noticed its end. Processes this launcher stopped are not failures."""
    events = [(report["time_ns"], report["rank"], report) for report in reports]
    reported = {report["rank"] for report in reports}
    for index, noticed_ns in watch.ended_ns.items():
        rank, exitcode = first_rank + index, watch.processes[index].exitcode
        if rank in reported or exitcode == 0 or index in watch.stopped:
            continue
        told = [r for r in reports if r.get("ended_peers") is not None]
        before = [r["time_ns"] for r in told if rank in r["ended_peers"]]  # it had ended when these were written
        after = [r["time_ns"] for r in told if rank not in r["ended_peers"]]  # it was still running then
        if before:
            time_ns = min(min(before) - 1, noticed_ns)
        elif after:
            time_ns = max(max(after) + 1, noticed_ns - DEATH_NOTICE_SLACK_NS)
        else:
            time_ns = noticed_ns - DEATH_NOTICE_SLACK_NS
        events.append((time_ns, rank, {"rank": rank, "how": how_it_ended(exitcode), "traceback": None}))
    return sorted(events, key=lambda event: (event[0], event[1]))


def failure_message(watch, reports: List[dict], plan: LaunchPlan) -> str:
    """Which rank failed first and how, then the others that failed before they were stopped."""
    events = failure_events(watch, reports, plan.rank)
    if not events:  # not reached after a failure; kept so that the message is never empty
        return f"a process of the {plan.world_size} failed"
    (_, first_rank, first), later = events[0], [rank for _, rank, _ in events[1:]]
    message = f"rank {first_rank} of {plan.world_size} {first.get('how', 'failed')}"
    if later:
        message += f", then rank(s) {', '.join(map(str, later))} failed too"
    failed = {rank for _, rank, _ in events}
    stopped = [plan.rank + i for i in sorted(watch.stopped) if plan.rank + i not in failed]
    if stopped:
        message += f"; rank(s) {', '.join(map(str, stopped))} {'was' if len(stopped) == 1 else 'were'} stopped"
    message += f": {first['error']}" if first.get("error") else "."
    if first.get("traceback"):
        message += f" Its traceback:\n{first['traceback']}"
    return message
