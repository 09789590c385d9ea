"""`agent-r1 serve`'s config reaches the engine it starts."""

from __future__ import annotations

import pytest
import torch

from agent_r1.cli import main
from agent_r1.engines.cpu import local_engine
from agent_r1.serve import server


class Started(Exception):
    """Raised by the stand-in engine: the test needs the engine's arguments, not a running server."""


@pytest.mark.parametrize("value, dtype", [("auto", None), ("bf16", torch.bfloat16)])
def test_kv_cache_dtype_reaches_the_engine(value, dtype, tiny_model_dir, monkeypatch):
    seen = {}

    def engine(model, tokenizer, **kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setattr(local_engine, "LocalEngine", engine)  # what make_engine builds
    with pytest.raises(Started):
        server.run_serve(server.ServeConfig(model=str(tiny_model_dir), kv_cache_dtype=value))
    assert seen["kv_cache_dtype"] is dtype and seen["pack_weights"] is True


def test_an_unknown_kv_cache_dtype_is_one_line(capsys):
    assert main(["serve", "kv_cache_dtype=fp16"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype" in err and "fp16" in err and err.count("\n") == 1
