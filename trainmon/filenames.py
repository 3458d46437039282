"""One spelling of any text (a run id, mostly) that is safe as a file or directory name."""

from __future__ import annotations

import hashlib
import re

_ALREADY_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(text: str) -> str:
    """``text`` as a file name: unchanged when it already is a short, plain one; otherwise
    its unsafe characters replaced, cut, and a digest of the whole text added, so two
    texts that differ only in what was replaced or cut still get two names."""
    if _ALREADY_SAFE.fullmatch(text) and text not in (".", ".."):
        return text
    cleaned = _UNSAFE_RUN.sub("_", text)[:48].strip("._") or "run"
    return f"{cleaned}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"
