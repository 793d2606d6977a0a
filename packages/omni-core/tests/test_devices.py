import pytest
from omni_core.worker.devices import resolve_devices


@pytest.mark.parametrize(
    "devices,parent,expected",
    [
        (None, "0,1", None),
        ("cpu", "0", ""),
        ("0", None, "0"),
        ("1, 2", "0,1,2", "1,2"),
        (1, "2,5,7", "5"),
        (0, None, "0"),
        (3, None, "3"),
    ],
)
def test_resolve(devices, parent, expected):
    assert resolve_devices(devices, parent) == expected


def test_logical_index_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        resolve_devices(3, "2,5,7")
