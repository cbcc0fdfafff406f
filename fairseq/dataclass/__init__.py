"""Config dataclasses (`configs`) and their command-line form (`utils`); the front ends that read them are
fairseq.frontend."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class FairseqDataclass:
    """Upstream's base of config dataclasses, kept for plug-ins (--user-dir) that subclass it; fields with
    `metadata={"help": ...}` become flags as this fork's own configs do."""

    _name: Optional[str] = None
