"""The settings every rule has (a leaf: the rules, the incident book and config.py import it)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

Severity = Literal["info", "warning", "critical"]


class RuleConfig(BaseModel):
    """Settings every rule has. A condition must hold for ``fire_after`` observations in a
    row (and ``fire_after_s`` seconds of record time) to fire; ``clear_after`` healthy
    observations resolve it; after resolving, the same incident waits ``cooldown_s``
    before it may fire again. ``escalate_factor``: while an incident is open, a value that
    many times worse than the one it fired with notifies again (the open incident resolves
    as superseded and a new one fires); None: never."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = True
    severity: Severity = "warning"
    fire_after: int = Field(1, ge=1)
    fire_after_s: float = Field(0.0, ge=0)
    clear_after: int = Field(1, ge=1)
    cooldown_s: float = Field(60.0, ge=0)
    escalate_factor: Optional[float] = Field(None, gt=1)
