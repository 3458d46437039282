"""A forwarder whose library is missing says which extra to install, and exits cleanly."""

from __future__ import annotations

import importlib
import sys

import pytest

SINKS = [("wandb", "wandb_sink", "WandbSink", {}),
         ("aim", "aim_sink", "AimSink", {"repo": "unused"}),
         ("tensorboard", "tensorboard_sink", "TensorBoardSink", {"logdir": "unused"})]


@pytest.mark.parametrize("library, module, cls, kwargs", SINKS)
def test_missing_library_names_the_extra(library, module, cls, kwargs, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, library, None)  # makes `import library` fail
    sink_module = importlib.import_module(f"trainmon.consumers.{module}")
    from trainmon.consumers.forwarding import MissingDependency

    with pytest.raises(MissingDependency, match=rf"pip install 'trainmon\[{library}\]'"):
        getattr(sink_module, cls)(**kwargs)
    assert sink_module.main(["--exit-when-idle", "0"]) == 2
    assert f"pip install 'trainmon[{library}]'" in capsys.readouterr().err
