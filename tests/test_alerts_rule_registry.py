"""The rule contract: each rule registers itself once with its name and settings model, its
state round-trips through the one codec (a checkpoint in the middle of a run changes no
alert), an engine state of another version is refused (the service then rebuilds from the
topics), and the docs' rules tables are the ones the rules generate."""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from pathlib import Path
from typing import Optional

import pytest
from pydantic import Field

from trainmon.consumers.alerts.config import RULE_NAMES, RuleConfig, Rules
from trainmon.consumers.alerts.rules import RULES, Rule, base, codec
from trainmon.consumers.alerts.rules.docs import class_rule_families, update
from trainmon.consumers.alerts.stats import RollingMedian, TwoHalves

from .alerts_support import engine_with, synthetic_run
from .test_alerts_rules import SCENARIOS, SILENCE_S, TEST_SETTINGS, T0

DOC = Path(__file__).resolve().parents[1] / "docs" / "alerts.md"


def test_the_registry_is_the_settings_and_the_engine_rules_in_one_order():
    from trainmon.consumers.alerts.engine import RULE_CLASSES

    assert list(RULES) == list(RULE_NAMES) == list(RULE_CLASSES)
    for name, entry in RULES.items():
        assert Rules.model_fields[name].annotation is entry.config
        assert issubclass(entry.rule, Rule)


def test_a_rule_registers_itself_with_its_name_and_settings(monkeypatch):
    monkeypatch.setattr(base, "RULES", dict(base.RULES))

    class Wobble(RuleConfig):
        limit: float = Field(3.0, gt=0)

    class WobbleRule(Rule, name="wobble", config=Wobble):
        kinds = ("step",)

    assert list(base.RULES)[-1] == "wobble" and base.RULES["wobble"] == (WobbleRule, Wobble)
    with pytest.raises(ValueError, match="'wobble' is defined twice"):
        class Again(Rule, name="wobble", config=Wobble):
            pass
    with pytest.raises(TypeError, match="RuleConfig"):
        class Loose(Rule, name="loose", config=dict):
            pass


def test_every_rule_state_is_a_dataclass():
    for name, entry in RULES.items():
        for state in (entry.rule.rank_state, entry.rule.run_state):
            assert state is None or dataclasses.is_dataclass(state), name


@dataclasses.dataclass(slots=True)
class Sample:
    window: RollingMedian = codec.window("window")
    halves: TwoHalves = codec.window("window")
    by_set: dict[int, RollingMedian] = codec.windows("window")
    recent: deque[tuple[int, float]] = dataclasses.field(default_factory=deque)
    seen: set[int] = dataclasses.field(default_factory=set)
    best: Optional[float] = None
    scratch: int = codec.transient(default=0)


class SampleConfig(RuleConfig):
    window: int = 4


def test_the_codec_round_trips_by_field_and_sizes_windows_from_the_settings():
    st = codec.new(Sample, SampleConfig())
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        st.window.push(v)
        st.halves.push(v)
    st.by_set[1] = RollingMedian(4, [7.0])
    st.recent.append((3, 0.5))
    st.seen.update({5, 2})
    st.best, st.scratch = 1.5, 99
    saved = json.loads(json.dumps(codec.dump(st)))
    assert "scratch" not in saved and saved["seen"] == [2, 5]
    back = codec.load(Sample, saved, SampleConfig())
    assert list(back.window.values) == [2.0, 3.0, 4.0, 5.0] and back.window.median == 3.5
    assert back.halves.dump() == [2.0, 3.0, 4.0, 5.0] and back.by_set[1].median == 7.0
    assert back.recent == deque([(3, 0.5)]) and back.seen == {2, 5} and back.best == 1.5
    assert back.scratch == 0
    smaller = codec.load(Sample, saved, SampleConfig(window=2))  # a setting changed across a restart
    assert list(smaller.window.values) == [4.0, 5.0]
    assert codec.load(Sample, {}, SampleConfig()).window.size == 4  # a field it lacks


def checkpointed(records, cut: int) -> list:
    """The alerts of ``records`` with the engine saved (as JSON) and restored at ``cut``."""
    engine, out = engine_with(**TEST_SETTINGS), []
    for i, record in enumerate(records):
        if i == cut:
            state = json.loads(json.dumps(engine.dump()))
            engine = engine_with(**TEST_SETTINGS)
            engine.load(state)
        out += engine.process(record) + engine.tick()
    out += engine.tick(now=max(r.time.timestamp() for r in records) + SILENCE_S)
    return [(a.rule, a.state, a.step, a.message) for a in out]


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: sc.rule)
def test_a_checkpoint_in_the_middle_of_a_run_changes_no_alert(sc):
    kwargs = {"steps": 80, **sc.bad_run}
    records = synthetic_run(f"{sc.rule}-ckpt", t0=T0, ranks=sc.ranks, mutate=sc.mutate, **kwargs)
    uninterrupted = checkpointed(records, cut=-1)
    assert any(state == "firing" for _, state, _, _ in uninterrupted), sc.rule
    assert checkpointed(records, cut=len(records) * 3 // 5) == uninterrupted


def test_an_engine_state_of_another_version_is_refused():
    """The service catches this and rebuilds the windows from the topics."""
    engine = engine_with()
    old = {**engine.dump(), "version": 2}
    with pytest.raises(ValueError, match="version 2"):
        engine_with().load(old)


def test_docs_show_the_rules_tables_as_generated():
    doc = DOC.read_text()
    families = class_rule_families()
    assert "health" in families and "thresholds" not in families
    assert update(doc) == doc, "regenerate them: python -m trainmon.consumers.alerts --write docs/alerts.md"
    for name in RULES:
        assert f"| `{name}` |" in doc, name


def test_every_rule_with_logic_documents_itself():
    for name, entry in RULES.items():
        if entry.rule.__module__.endswith(".thresholds"):
            continue
        assert entry.rule.fires_when and entry.rule.catches and entry.rule.checked_on, name
