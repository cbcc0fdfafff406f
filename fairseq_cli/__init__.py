"""fairseq's command-line entry points (fairseq-train, fairseq-preprocess, ...).

A Ctrl-C while an entry point is still importing its modules (torch takes seconds) ends it with one line, not
the import's traceback; once running, each command reports a signal itself (what it cleaned up, its status)."""

import os
import sys


def _interrupted_in_one_line(kind, value, traceback, previous=sys.excepthook):
    if issubclass(kind, KeyboardInterrupt):
        print(f"{os.path.basename(sys.argv[0] or 'fairseq')}: interrupted by SIGINT", file=sys.stderr)
        return  # the interpreter still ends the process as killed by SIGINT (status 130 in a shell)
    previous(kind, value, traceback)


if sys.excepthook is sys.__excepthook__:  # the user's own hook (an IDE's, a debugger's) is kept
    sys.excepthook = _interrupted_in_one_line
