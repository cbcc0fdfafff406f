"""Config dataclasses (`configs`), their command-line and hydra forms (`utils`, `hydra`)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class FairseqDataclass:
    """Upstream's base of config dataclasses, kept for plug-ins (--user-dir) that subclass it; fields with
    `metadata={"help": ...}` become flags as this fork's own configs do."""

    _name: Optional[str] = None
