"""The base of errors a user can fix (a damaged or missing file, a full disk): the launcher reports them for each
rank as their message on one line, without a traceback, as fairseq-train does in one process."""


class UserError(Exception):
    """Told to the user as its message alone; subclasses say what was wrong and what to do."""
