"""``omni run`` on a DiT pipeline, as in a CI log (stderr not a terminal): a plain line of
sampling progress as it happens and one at the end, the final image written under the
name its ``media_type`` gives, and a summary with each stage's queue wait."""

import json
import re

import yaml
from omni_core import cli
from omni_dit.testing import dit_config


def test_omni_run_shows_sampling_progress_and_queue_waits(tiny_dit, tmp_path, capsys):
    cfg = dit_config(tiny_dit, heartbeat_interval_s=0.2)
    path = tmp_path / "dit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    request = {"prompt": "a fox", "image": {"width": 64, "height": 64, "steps": 8}}
    request["image"]["preview_every"] = 2
    out_dir = tmp_path / "out"
    argv = ["run", str(path), "--input", json.dumps(request), "--out", str(out_dir)]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err and "\033[" not in err
    bar = [ln for ln in err.splitlines() if re.match(r"[0-9a-f]{8} sample ", ln)]
    assert re.search(r" 2/8 steps \(25%\)", bar[0]), err  # the first preview's step
    assert re.search(r" 8/8 steps \(100%\)  \d+\.\ds", bar[-1]), err  # done: the final image
    (jpeg,) = out_dir.glob("*.jpg")  # dit.encode's media_type: image/jpeg
    assert f"wrote {jpeg}" in err and jpeg.read_bytes()[:2] == b"\xff\xd8"
    assert out.count("[sample] image") == 3  # previews at 2, 4, 6, on stdout

    header, *rows = err[err.index("stage ") :].strip().splitlines()
    assert header.split()[6:9] == ["first", "last", "queued"]
    table = {r.split()[0]: r.split() for r in rows}
    assert list(table) == ["text", "plan", "sample", "vae", "encode"]
    for name, row in table.items():
        queued = row[7]
        assert queued.endswith("s") and 0.0 <= float(queued[:-1]) < 60.0, (name, row)
    assert table["sample"][4] == "6" and table["encode"][4] == "8"  # steps the caller saw
