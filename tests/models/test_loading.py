"""Converting a bundled GGUF model: its de-quantizing bar follows transformers' progress-bar switch."""

from __future__ import annotations

import io

import pytest
import transformers.modeling_gguf_pytorch_utils as gguf
from transformers.utils import logging as hf_logging

from agent_r1.models.loading import _gguf_bar_as_transformers_bars


@pytest.mark.parametrize("shown", [False, True])
def test_the_gguf_bar_is_shown_only_when_transformers_bars_are(shown):
    """transformers' GGUF conversion draws a plain tqdm bar that `disable_progress_bar()` (our commands
    without --verbose) did not reach: it printed through every first run of a command on Gemma."""
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    bar = gguf.tqdm
    try:
        out = io.StringIO()
        with _gguf_bar_as_transformers_bars():
            for _ in gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=out):
                pass
        assert ("de-quantizing" in out.getvalue()) == shown
        assert gguf.tqdm is bar  # put back afterwards
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
