"""The keys file of ``omni serve --api-keys-file``: read strictly (each bad file names the
field or line, and ``omni serve`` refuses to start with it), keys compared against every
key, the one key of ``--api-key`` a key named ``default`` without limits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from omni_serve.keys import (
    DEFAULTS,
    MAX_WEIGHT,
    MIN_KEY_CHARS,
    SINGLE_KEY_NAME,
    ApiKey,
    KeysFileError,
    identify,
    load_keys_file,
    parse_keys,
)
from omni_serve.settings import ServeSettings, SettingsError

from .conftest import OMNI

KEY_A = "a" * MIN_KEY_CHARS
KEY_B = "b" * MIN_KEY_CHARS


def write(tmp_path, text: str, name: str = "keys.toml", mode: int = 0o600):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_toml_file_with_defaults_and_per_key_limits(tmp_path):
    path = write(
        tmp_path,
        f'[defaults]\nmax_inflight = 3\n\n[[keys]]\nname = "alice"\nkey = "{KEY_A}"\n'
        f'max_connections = 2\nbest_priority = -5\n\n[[keys]]\nname = "bob"\nkey = "{KEY_B}"\n',
    )
    alice, bob = load_keys_file(path)
    assert (alice.name, alice.key, alice.max_connections, alice.max_inflight) == (
        "alice",
        KEY_A,
        2,
        3,
    )
    assert alice.best_priority == -5 and alice.max_queued == DEFAULTS["max_queued"]
    assert (bob.max_connections, bob.max_inflight, bob.best_priority) == (
        DEFAULTS["max_connections"],
        3,
        0,
    )
    assert KEY_A not in repr(alice)


def test_a_json_file(tmp_path):
    doc = {"keys": [{"name": "svc.1", "key": KEY_A, "max_queued": 1}]}
    (key,) = load_keys_file(write(tmp_path, json.dumps(doc), "keys.json"))
    assert (key.name, key.max_queued) == ("svc.1", 1)


@pytest.mark.parametrize(
    ("entry", "names"),
    [
        ({"name": "a", "key": KEY_A[:-1]}, "keys[0] ('a').key"),  # one short of the length
        ({"name": "a", "key": KEY_A[:-1] + " "}, "keys[0] ('a').key"),
        ({"name": "-a", "key": KEY_A}, "keys[0].name"),
        ({"name": "a" * 65, "key": KEY_A}, "keys[0].name"),
        ({"name": "a", "key": KEY_A, "max_inflight": 0}, "keys[0] ('a').max_inflight"),
        ({"name": "a", "key": KEY_A, "max_queued": True}, "keys[0] ('a').max_queued"),
        ({"name": "a", "key": KEY_A, "max_connections": 1.5}, "('a').max_connections"),
        ({"name": "a", "key": KEY_A, "best_priority": 1}, "keys[0] ('a').best_priority"),
        ({"name": "a", "key": KEY_A, "best_priority": -(2**63) - 1}, "best_priority"),
        ({"name": "a", "key": KEY_A, "priority": 1}, "keys[0].priority: unknown field"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": 10.001}, "('a').refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": 11}, "('a').refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": -0.001}, "('a').refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": "1"}, "('a').refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": True}, "('a').refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": float("nan")}, "refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "refusal_delay_s": float("inf")}, "refusal_delay_s"),
        ({"name": "a", "key": KEY_A, "weight": 0}, "keys[0] ('a').weight: expected an integer"),
        ({"name": "a", "key": KEY_A, "weight": MAX_WEIGHT + 1}, "('a').weight"),
        ({"name": "a", "key": KEY_A, "weight": 1.5}, "('a').weight"),
        ({"name": "a", "key": KEY_A, "weight": True}, "('a').weight"),
        ({"name": "a", "key": KEY_A, "weight": "2"}, "('a').weight"),
    ],
)
def test_a_bad_entry_is_refused_naming_its_field(entry, names):
    with pytest.raises(KeysFileError) as e:
        parse_keys({"keys": [entry]}, "k.toml")
    assert names in str(e.value)


def test_limits_at_their_edge_pass():
    (key,) = parse_keys(
        {"keys": [{"name": "a", "key": KEY_A, "max_inflight": 1, "best_priority": -(2**63)}]}
    )
    assert key.max_inflight == 1 and key.best_priority == -(2**63)
    assert key.refusal_delay_s == DEFAULTS["refusal_delay_s"] == 1.0
    for edge in (0, 10, 10.0, 0.25):
        (key,) = parse_keys({"keys": [{"name": "a", "key": KEY_A, "refusal_delay_s": edge}]})
        assert key.refusal_delay_s == float(edge) and isinstance(key.refusal_delay_s, float)
    (key,) = parse_keys({"defaults": {"refusal_delay_s": 0}, "keys": [{"name": "a", "key": KEY_A}]})
    assert key.refusal_delay_s == 0.0
    assert key.weight == DEFAULTS["weight"] == 1
    for edge in (1, MAX_WEIGHT):
        (key,) = parse_keys({"keys": [{"name": "a", "key": KEY_A, "weight": edge}]})
        assert key.weight == edge
    (key,) = parse_keys({"defaults": {"weight": 7}, "keys": [{"name": "a", "key": KEY_A}]})
    assert key.weight == 7


def test_names_and_keys_are_unique_and_the_file_well_formed():
    twice = {"keys": [{"name": "a", "key": KEY_A}, {"name": "a", "key": KEY_B}]}
    with pytest.raises(KeysFileError, match=r"keys\[1\] \('a'\).name: also the name of keys\[0\]"):
        parse_keys(twice)
    same = {"keys": [{"name": "a", "key": KEY_A}, {"name": "b", "key": KEY_A}]}
    with pytest.raises(KeysFileError, match=r"keys\[1\] \('b'\).key: the same key as keys\[0\]"):
        parse_keys(same)
    for doc, names in (
        ({"keys": []}, "keys: expected a list"),
        ({}, "keys: expected a list"),
        ({"keys": [{"name": "a", "key": KEY_A}], "extra": 1}, "extra: unknown field"),
        ({"defaults": {"max_inflight": 0}, "keys": []}, "defaults.max_inflight"),
        ({"defaults": {"max_streams": 1}, "keys": []}, "defaults.max_streams: unknown"),
    ):
        with pytest.raises(KeysFileError, match=names):
            parse_keys(doc)


def test_the_file_itself_is_checked(tmp_path):
    good = f'[[keys]]\nname = "a"\nkey = "{KEY_A}"\n'
    with pytest.raises(KeysFileError, match="mode 640 lets other users read"):
        load_keys_file(write(tmp_path, good, mode=0o640))
    with pytest.raises(KeysFileError, match="line 3"):
        load_keys_file(write(tmp_path, good.replace('key = "', "key = ")))
    with pytest.raises(KeysFileError, match="line 1, column"):
        load_keys_file(write(tmp_path, "{", "keys.json"))
    with pytest.raises(KeysFileError, match=r"expected a \.toml or \.json"):
        load_keys_file(write(tmp_path, good, "keys.yaml"))
    (tmp_path / "link.toml").symlink_to(write(tmp_path, good))
    with pytest.raises(KeysFileError):
        load_keys_file(tmp_path / "link.toml")  # never followed


def test_identify_compares_every_key():
    a, b = ApiKey("a", KEY_A), ApiKey("b", KEY_B)
    assert identify([a, b], f"Bearer {KEY_B}") is b
    assert identify([a, b], f"bearer  {KEY_A} ") is a
    for header in (KEY_A, f"Basic {KEY_A}", f"Bearer {KEY_A}x", "Bearer ", ""):
        assert identify([a, b], header) is None


def test_the_single_key_is_one_key_without_limits():
    s = ServeSettings(model_name="m", api_key="s3cret")
    (key,) = s.keys
    assert (key.name, key.key) == (SINGLE_KEY_NAME, "s3cret")
    assert (key.max_connections, key.max_inflight, key.max_queued, key.best_priority) == (
        None,
        None,
        None,
        None,
    )
    assert s.max_connections_per_address is None
    assert ServeSettings(model_name="m").keys == ()
    with pytest.raises(SettingsError, match="not both"):
        ServeSettings(model_name="m", api_key="x", api_keys=(ApiKey("a", KEY_A),))


def test_serve_refuses_a_bad_keys_file_at_start(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("name: p\nstages: [{name: s, kind: synthetic.source}]\n")
    bad = write(tmp_path, f'[[keys]]\nname = "a"\nkey = "{KEY_A}"\nmax_inflight = 0\n')
    r = subprocess.run(
        [sys.executable, "-c", OMNI, "serve", str(cfg), "--api-keys-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "keys[0] ('a').max_inflight: expected a positive integer, got 0" in r.stderr
    assert KEY_A not in r.stderr
