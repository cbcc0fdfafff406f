"""The start-up notices of upstream options accepted without their behaviour (upstream_absent.ACCEPTED_OPTIONS):
read from the config groups alone, so the training loop and every entry point log them the same way."""

import logging

from fairseq.dataclass.utils import flag_name
from fairseq.upstream_absent import ACCEPTED_OPTIONS

logger = logging.getLogger(__name__)

# Upstream options accepted without their behaviour: (group, field, what happens instead), from the one table.
COMPAT_NOTICES = ACCEPTED_OPTIONS


def compat_notices(**groups) -> list:
    """One line per COMPAT_NOTICES option set in `groups`, a config's groups by name (`common=cfg.common`, or
    `**vars(cfg)` for a whole config); groups not given are skipped."""
    lines = []
    for group_name, name, instead in COMPAT_NOTICES:
        group = groups.get(group_name)
        if group is None or not hasattr(group, name):
            continue
        value = getattr(group, name)
        if value != getattr(type(group)(), name):  # set to other than the group's default
            shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            flag = flag_name(name) + ("" if isinstance(value, bool) else f" {shown}")
            lines.append(f"{flag} is accepted for upstream compatibility: {instead}")
    return lines


def announce_compat_options(**groups) -> None:
    """Log compat_notices(**groups), one info line each: called once by each entry point at start-up."""
    for line in compat_notices(**groups):
        logger.info(line)
