"""Socket directories: owner-locked while their pipeline lives, swept once it died."""

import os
import tempfile

import pytest
from omni_core.dataplane import transport
from omni_core.dataplane.transport import (
    OWNER_LOCK,
    make_socket_dir,
    remove_socket_dir,
    sweep_socket_dirs,
)
from omni_testing.faults import child_reporting

# a process that makes a socket directory in ``argv[1]`` and lives until its stdin closes
_OWNER = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from omni_core.dataplane.transport import make_socket_dir
path = make_socket_dir()
open(path + "/stage.spec.json", "w").write("{}")
print(path, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch):
    """The temp directory make_socket_dir uses, private to the test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _owner_process(directory):
    return child_reporting(_OWNER, str(directory))


def test_a_socket_dir_is_private_locked_and_removed_with_its_lock(tmpdir_):
    path = make_socket_dir()
    assert os.path.dirname(path) == str(tmpdir_)
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert os.path.exists(os.path.join(path, OWNER_LOCK))
    assert sweep_socket_dirs() == []  # ours, alive
    remove_socket_dir(path)
    assert not os.path.exists(path) and path not in transport._owned_dirs


def test_a_sigkilled_owners_socket_dir_is_swept_by_the_next_start(tmpdir_):
    p, dead = _owner_process(tmpdir_)
    p.kill()
    p.wait()
    assert os.path.exists(os.path.join(dead, "stage.spec.json"))
    mine = make_socket_dir()  # the next start
    try:
        assert not os.path.exists(dead)
        assert os.listdir(tmpdir_) == [os.path.basename(mine)]
    finally:
        remove_socket_dir(mine)


def test_a_live_owners_socket_dir_is_never_swept(tmpdir_):
    p, live = _owner_process(tmpdir_)
    try:
        assert sweep_socket_dirs() == []
        mine = make_socket_dir()
        remove_socket_dir(mine)
        assert os.path.exists(os.path.join(live, "stage.spec.json"))
    finally:
        p.stdin.close()
        p.wait()
    assert sweep_socket_dirs() == [live]  # its owner exited without removing it


def test_the_sweep_leaves_what_is_not_a_dead_owners_socket_dir(tmpdir_):
    keep = []
    legacy = tmpdir_ / "omni-legacy"  # no owner lock: another program's, or older
    legacy.mkdir(mode=0o700)
    (legacy / "stage.spec.json").write_text("{}")
    keep.append(legacy)
    shared = tmpdir_ / "omni-shared"  # not private
    shared.mkdir(mode=0o755)
    (shared / OWNER_LOCK).write_bytes(b"")
    (shared / OWNER_LOCK).chmod(0o600)
    keep.append(shared)
    target = tmpdir_ / "elsewhere"
    target.mkdir(mode=0o700)
    (target / OWNER_LOCK).write_bytes(b"")
    (target / OWNER_LOCK).chmod(0o600)
    link = tmpdir_ / "omni-link"  # a link to a directory: never followed
    link.symlink_to(target)
    keep += [target, link]
    plain = tmpdir_ / "omni-file"
    plain.write_bytes(b"x")
    keep.append(plain)
    if os.geteuid() == 0:  # another user's directory (only root can make one)
        foreign = tmpdir_ / "omni-foreign"
        foreign.mkdir(mode=0o700)
        (foreign / OWNER_LOCK).write_bytes(b"")
        (foreign / OWNER_LOCK).chmod(0o600)
        os.chown(foreign, 65534, 65534)
        keep.append(foreign)
    assert sweep_socket_dirs() == []
    assert sorted(tmpdir_.iterdir()) == sorted(keep)
    path = make_socket_dir()  # a start is not failed by any of them
    remove_socket_dir(path)
    assert sweep_socket_dirs(str(tmpdir_ / "missing")) == []


def test_a_socket_dir_the_sweep_may_not_remove_fails_nothing(tmpdir_, monkeypatch):
    p, dead = _owner_process(tmpdir_)
    p.kill()
    p.wait()

    def refuse(path, *a, **kw):
        raise PermissionError(1, "Operation not permitted", path)

    with monkeypatch.context() as m:
        m.setattr(transport.shutil, "rmtree", refuse)
        assert sweep_socket_dirs() == []
    assert os.path.exists(dead)
    assert sweep_socket_dirs() == [dead]


def test_a_socket_dir_removed_by_its_user_lets_go_of_its_lock(tmpdir_):
    import shutil

    path = make_socket_dir()
    shutil.rmtree(path)  # as a user that does not call remove_socket_dir (Ray's gateway)
    other = make_socket_dir()
    assert path not in transport._owned_dirs
    remove_socket_dir(other)
