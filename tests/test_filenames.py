"""One file-name spelling of a run id, shared by the forwarders' files and the report."""

from __future__ import annotations

from trainmon.filenames import safe_name


def test_a_plain_run_id_is_its_own_file_name():
    assert safe_name("llama-7b_run.3") == "llama-7b_run.3"


def test_other_ids_get_a_short_name_that_still_tells_them_apart():
    slash, colon = safe_name("team/run:1"), safe_name("team:run/1")
    assert slash.startswith("team_run_1-") and colon.startswith("team_run_1-")
    assert slash != colon
    assert safe_name(".").startswith("run-") and safe_name("..") != safe_name(".")
    long = safe_name("x" * 300)
    assert len(long) <= 64 and long != safe_name("x" * 301)
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in safe_name("ünïcode run ✓"))
