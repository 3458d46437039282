"""The log formats ``trainmon ingest`` reads, by name. A new format is a module with
a FormatParser subclass and one entry here (plus its corpus log and test).

Auto-detection asks the formats in this order, line by line, until one recognises a
line; each ``detect`` only says yes to lines unmistakably its own.
"""

from __future__ import annotations

from .base import FormatParser
from .hf_trainer import HfTrainerParser
from .megatron import MegatronParser
from .modded_nanogpt import ModdedNanoGptParser
from .nanogpt import NanoGptParser
from .nemo import NemoParser
from .surogate import SurogateParser
from .torchtitan import TorchTitanParser

FORMATS: dict[str, type[FormatParser]] = {
    parser.name: parser
    for parser in (MegatronParser, NemoParser, TorchTitanParser, NanoGptParser, HfTrainerParser,
                   SurogateParser, ModdedNanoGptParser)
}
# Other names people know these formats by.
ALIASES = {"megatron-lm": "megatron", "megatron-core": "megatron", "megatron-bridge": "megatron",
           "megatron-deepspeed": "megatron",
           "nemo1": "nemo", "nemo2": "nemo",
           "titan": "torchtitan",
           "nanoGPT": "nanogpt",
           "hf": "hf-trainer", "transformers": "hf-trainer", "huggingface": "hf-trainer",
           "trl": "hf-trainer", "ms-swift": "hf-trainer", "swift": "hf-trainer",
           "trainmon": "surogate", "jsonl": "surogate"}


def by_name(name: str) -> type[FormatParser]:
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        known = ", ".join(sorted([*FORMATS, *ALIASES]))
        raise ValueError(f"unknown log format {name!r}; known: auto, {known}")
    return FORMATS[name]


__all__ = ["ALIASES", "FORMATS", "FormatParser", "by_name"]
