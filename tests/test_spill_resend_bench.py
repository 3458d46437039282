"""benchmarks/spill_resend.py at a small size: both ways send every record back, and
only the rewrite writes (the figure the script prints)."""

from __future__ import annotations

import pytest

from .benchmark_scripts import load_benchmark
from .test_spill_edges import punching_works

spill_resend = load_benchmark("spill_resend")


def test_a_resend_in_place_writes_nothing_where_the_rewrite_copies_the_rest(tmp_path):
    if not punching_works(tmp_path):
        pytest.skip("this filesystem cannot punch holes")
    size = 24 << 20  # three batches
    in_place = spill_resend.resend(tmp_path, size, in_place=True)
    rewrite = spill_resend.resend(tmp_path, size, in_place=False)
    assert in_place["size"] >= size and rewrite["size"] >= size
    assert spill_resend.written_bytes() > 0  # (/proc/self/io is there to read)
    assert in_place["written"] < 1 << 20
    assert rewrite["written"] > size  # the rest copied after each of the first batches
