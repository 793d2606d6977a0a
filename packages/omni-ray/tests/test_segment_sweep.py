"""The pipeline's segment sweep (``unlink_pipeline_segments``) unlinks this user's
segments of the pipeline and skips what is not ours: a file another user planted under
the pipeline's id, and one it may not unlink, are logged and left, and the rest swept."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import secrets

import pytest
from omni_core.dataplane.shm import SHM_DIR
from omni_ray.segments import unlink_pipeline_segments


def plant(directory: str, pipeline_id: str, label: str) -> str:
    name = f"omni-{os.getpid()}-{pipeline_id}-{label}-0-{secrets.token_hex(8)}"
    fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    return name


@pytest.fixture
def pipeline_id() -> str:
    return secrets.token_hex(5)


def test_a_file_of_another_user_is_skipped_and_the_rest_swept(pipeline_id, caplog):
    if os.geteuid() != 0:
        pytest.skip("planting another user's file takes root")
    nobody = pwd.getpwnam("nobody").pw_uid
    ours = [plant(SHM_DIR, pipeline_id, w) for w in ("a", "b")]
    theirs = plant(SHM_DIR, pipeline_id, "planted")
    other = plant(SHM_DIR, secrets.token_hex(5), "a")  # another pipeline's
    path = os.path.join(SHM_DIR, theirs)
    os.chown(path, nobody, nobody)
    try:
        with caplog.at_level(logging.WARNING, logger="omni.ray"):
            assert sorted(unlink_pipeline_segments(pipeline_id)) == sorted(ours)
        assert os.path.exists(path) and os.path.exists(os.path.join(SHM_DIR, other))
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in ours)
        (said,) = [r.getMessage() for r in caplog.records]
        assert theirs in said and f"uid {nobody}" in said, said
    finally:
        for n in (*ours, theirs, other):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, n))


def test_a_file_it_may_not_unlink_is_skipped_and_the_rest_swept(
    tmp_path, pipeline_id, monkeypatch, caplog
):
    names = sorted(plant(str(tmp_path), pipeline_id, w) for w in ("a", "b", "c"))
    refused = names[1]
    unlink = os.unlink

    def no_permission(path: str) -> None:
        if path.endswith(refused):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        unlink(path)

    monkeypatch.setattr(os, "unlink", no_permission)
    with caplog.at_level(logging.WARNING, logger="omni.ray"):
        assert unlink_pipeline_segments(pipeline_id, str(tmp_path)) == [names[0], names[2]]
    assert sorted(os.listdir(tmp_path)) == [refused]
    (said,) = [r.getMessage() for r in caplog.records]
    assert refused in said and "Operation not permitted" in said, said
