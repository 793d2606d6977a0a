"""``omni trace --png``: the run as a timeline picture, a row per stage."""

import subprocess
import sys

import pytest
from omni_core.observability.trace_png import _lanes

Image = pytest.importorskip("PIL.Image")


def test_omni_trace_png_draws_the_run(tmp_path):
    out = tmp_path / "t.json"
    cmd = "import sys; from omni_core.cli import main; sys.exit(main())"
    r = subprocess.run(
        [sys.executable, "-c", cmd, "trace", "configs/demo.yaml", "--requests", "4"]
        + ["--out", str(out), "--png"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    png = out.with_suffix(".png")
    img = Image.open(png)
    assert img.format == "PNG" and img.width == 1200
    assert img.height >= 28 + 5 * 30  # an axis and a row per stage (4) and the caller
    colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 8  # bars in several request colours


def test_overlapping_bars_get_their_own_lanes():
    bars = [(0, 10, "a"), (5, 15, "b"), (10, 20, "c"), (12, 13, "d")]
    assert _lanes(bars) == [0, 1, 0, 2]
