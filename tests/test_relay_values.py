"""A rank's values, written by the relay (relay/values.py), in memory: for every kind a log
call may send as numbers, the relay writes the bytes the rank's own encoder writes; and a
layout the relay cannot write as the rank would is refused by name."""

from __future__ import annotations

import random

import pytest

from trainmon.producer.deferred import VALUES_AT, checked_values, queued
from trainmon.producer.encoding import Encoder
from trainmon.relay import frames
from trainmon.relay.values import LayoutRefused, layout_from_spec
from trainmon.schemas import Record, StepRecord

from .test_producer_quick_check import _all_numbers_may_do, quickly_checked_calls

ENVELOPE = (("run_id", "values"), ("rank", 0), ("world_size", 1), ("host", "h"))
ENCODER = Encoder([], 1_000_000, lambda record, reason: None)


def through_the_relay(item: tuple) -> bytes:
    """The JSON the relay writes of a log call's values, sent as the rank sends them."""
    kind, envelope, when, id_prefix, id_number, names = item[:VALUES_AT]
    values = item[VALUES_AT:]
    spec = frames.layout_spec("t.kind", b"run", kind, envelope, id_prefix, names, values)
    layout_id, spec = frames.parse_layout(frames.layout(7, spec)[4:])  # (past the length)
    layout = layout_from_spec(layout_id, spec)
    packer = frames.values_packer(spec["codes"])
    frame = packer.pack(packer.size - 4, frames.VALUES, 1, layout_id, when, id_number, *values)[4:]
    return layout.write(*frames.read_values(frame, layout.reader))


@pytest.mark.parametrize("model", [m for m in Record.registry.values() if _all_numbers_may_do(m)],
                         ids=lambda m: m.kind)
def test_the_relay_writes_a_calls_values_as_the_ranks_encoder_does(model):
    written = 0
    for number, fields, when in quickly_checked_calls(model, random.Random(f"relay-{model.kind}")):
        item = queued(model, ENVELOPE, when, "prefix", number, checked_values(model, fields))
        assert through_the_relay(item) == ENCODER.entry("t.kind", b"run", item)[2], fields
        written += 1
    assert written > 100


def step_spec(**changes) -> dict:
    item = queued(StepRecord, ENVELOPE, 1.7e9, "prefix", 1,
                  checked_values(StepRecord, dict(step=1, loss=2.0, timers={"forward": 1.0})))
    spec = frames.layout_spec("t.step", b"run", *item[:2], item[3], item[5], item[VALUES_AT:])
    return {**frames.parse_layout(frames.layout(1, spec)[4:])[1], **changes}


@pytest.mark.parametrize("changes, refusal", [
    (dict(kind="nonesuch"), "no record kind 'nonesuch'"),
    (dict(names=["step", "loss", "timers\0forward"], codes="qdq"), "'timers\\x00forward' is a float field, not code 'q'"),
    (dict(names=["step", "loss", "run_id"]), "'run_id' is not a field of a step record the quick check takes"),
    (dict(names=["step", "loss", "timers"]), "'timers' is not a field of a step record"),  # a map without its key
    (dict(names=["step", "loss"]), "3 value codes for names that are not a list of as many"),
    (dict(envelope=[["rank", 0], ["loss", 1.0]]), "envelope must be"),
    (dict(envelope=[["rank", [0]]]), "envelope must be"),
    (dict(envelope=[[["rank"], 0]]), "envelope must be"),  # (a name JSON may send that no dict takes)
    (dict(key="not hex"), "key must be hex"),
    (dict(topic=5), "must be strings"),
])
def test_a_layout_the_relay_cannot_write_as_the_rank_would_is_refused_by_name(changes, refusal):
    layout_from_spec(1, step_spec())  # (the layout itself is taken)
    with pytest.raises(LayoutRefused, match=refusal.replace("\\", "\\\\").replace("(", r"\(")):
        layout_from_spec(1, step_spec(**changes))
    spec = step_spec()
    del spec["names"]
    with pytest.raises(LayoutRefused, match="no 'names'"):
        layout_from_spec(1, spec)


def test_values_frames_that_are_not_the_format_are_refused_by_name():
    reader = frames.values_reader("qd")
    with pytest.raises(frames.FrameError, match="too short"):
        frames.values_ids(b"V\0\0")
    with pytest.raises(frames.FrameError, match="where its layout's take"):
        frames.check_values(b"V" + bytes(reader.size), reader)
    for not_json in (b"{nope", b"\xff", b"[" * 100_000):
        with pytest.raises(frames.FrameError, match="not JSON"):
            frames.parse_layout(b"L\0\1" + not_json)
    with pytest.raises(frames.FrameError, match="not a JSON object"):
        frames.parse_layout(b"L\0\1[1]")
