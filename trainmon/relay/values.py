"""A rank's checked values -> its record's JSON, on the relay (frames ``L`` and ``V``).

A rank whose relay runs its own schema sends a log call's numbers, not their JSON: the
values ``deferred.checked_values`` vouched for, packed as the call's layout says (the
shape a training loop repeats at every step: kind, envelope, field names), and the relay
writes the JSON as the rank's sender would (``DeferredRecord.encode``, the same bytes).
A layout is checked once, when it comes: a kind the relay knows, field names the quick
check takes for that kind, each with the code of its number type. A layout it refuses
(LayoutRefused) ends the values for that connection: the relay answers the hello again,
FAILED, and the rank writes the JSON itself from then on; a record it cannot write it
answers FAILED, and the rank writes that record itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..producer.deferred import DeferredRecord, rules_for
from ..schemas import Record
from . import frames

_ENVELOPE_VALUE_TYPES = (str, int, float, bool, type(None))


class LayoutRefused(ValueError):
    """A layout, well framed, whose records this relay cannot write as the rank would."""


@dataclass(frozen=True)
class Layout:
    topic: str
    key: bytes
    model: type[Record]
    envelope: dict
    id_prefix: str
    names: tuple[str, ...]
    reader: struct.Struct  # a V frame of this layout, from its type byte on

    def write(self, when: float, id_number: int, values: tuple) -> bytes:
        return DeferredRecord(self.model, dict(self.envelope), when, self.id_prefix, id_number,
                              self.names, values).encode()


def layout_from_spec(layout_id: int, spec: dict) -> Layout:
    """The layout a rank sent; LayoutRefused naming what the relay cannot take."""
    def refuse(why: str):
        raise LayoutRefused(f"layout {layout_id}: {why}")

    try:
        topic, key, kind, envelope, id_prefix, names, codes = (
            spec[name] for name in ("topic", "key", "kind", "envelope", "id_prefix", "names", "codes"))
    except KeyError as exc:
        refuse(f"no {exc.args[0]!r}")
    if not all(type(v) is str for v in (topic, key, kind, id_prefix, codes)):
        refuse("topic, key, kind, id_prefix and codes must be strings")
    model = Record.registry.get(kind)
    if model is None:
        refuse(f"no record kind {kind!r}")
    if (type(envelope) is not list or not all(type(p) is list and len(p) == 2 and type(p[0]) is str
                                              and p[0] in Record.model_fields
                                              and type(p[1]) in _ENVELOPE_VALUE_TYPES for p in envelope)):
        refuse("envelope must be [name, value] pairs of the envelope's fields")
    rules = rules_for(model)
    if type(names) is not list or len(names) != len(codes):
        refuse(f"{len(codes)} value codes for names that are not a list of as many")
    for name, code in zip(names, codes):
        rule = rules.get(name.split("\0", 1)[0]) if type(name) is str else None
        if rule is None or ("\0" in name) != rule.mapping:
            refuse(f"{name!r} is not a field of a {kind} record the quick check takes")
        if code != frames.VALUE_CODES[rule.number]:
            refuse(f"{name!r} is a {rule.number.__name__} field, not code {code!r}")
    try:
        key_bytes = bytes.fromhex(key)
    except ValueError:
        refuse("key must be hex")
    return Layout(topic, key_bytes, model, dict(envelope), id_prefix, tuple(names),
                  frames.values_reader(codes))
