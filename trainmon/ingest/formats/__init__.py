"""The log formats ``trainmon ingest`` reads, by name. A new format is a module with
a FormatParser subclass and one entry here (plus its corpus log and test)."""

from __future__ import annotations

from .base import FormatParser
from .megatron import MegatronParser

FORMATS: dict[str, type[FormatParser]] = {
    parser.name: parser
    for parser in (MegatronParser,)
}
# Other names people know these formats by.
ALIASES = {"megatron-lm": "megatron", "megatron-core": "megatron", "megatron-bridge": "megatron",
           "megatron-deepspeed": "megatron"}


def by_name(name: str) -> type[FormatParser]:
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        known = ", ".join(sorted([*FORMATS, *ALIASES]))
        raise ValueError(f"unknown log format {name!r}; known: auto, {known}")
    return FORMATS[name]


__all__ = ["ALIASES", "FORMATS", "FormatParser", "by_name"]
