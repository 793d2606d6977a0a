"""``omni models pull smollm2`` shows the long part of the conversion, transformers
de-quantizing the GGUF tensors, on omni's own bar (plain lines off a terminal), and a
worker that converts shows nothing of it."""

import io

import pytest
from omni_ar import models
from omni_core.observability.progress import Reporter

gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")


def test_the_gguf_tensor_loop_reports_to_the_pull():
    original = gguf_utils.tqdm
    out = io.StringIO()
    report = Reporter("smollm2", stream=out, tty=False)
    with models._gguf_tensor_progress(report):
        assert list(gguf_utils.tqdm(list(range(8)), desc="Converting...")) == list(range(8))
    assert gguf_utils.tqdm is original  # put back
    lines = out.getvalue().splitlines()
    assert "smollm2: de-quantizing the GGUF tensors 1/8 tensors (12%)" in lines[0]
    assert "8/8 tensors (100%)" in lines[-1]


def test_without_a_pull_the_loop_is_silent(capsys):
    with models._gguf_tensor_progress(None):
        assert list(gguf_utils.tqdm([1, 2, 3])) == [1, 2, 3]
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""
