"""Backend discovery through entry points, and device resolution (argument, environment, auto)."""

import pytest

from xpuspec import DeviceNotFoundError
from xpuspec.devices import backends, resolve_device, unavailable_backends


def test_backends_come_from_entry_points():
    found = backends()
    assert {"openvino", "torch"} <= set(found)
    assert list(found)[0] == "openvino"  # highest priority for cpu


def test_ipex_reports_why_it_cannot_load():
    reason = unavailable_backends().get("ipex", "")
    assert "intel_extension_for_pytorch" in reason


def test_env_and_argument_select_the_device(monkeypatch):
    monkeypatch.setenv("XPUSPEC_DEVICE", "cpu")
    backend, device = resolve_device()
    assert (backend.name, device) == ("openvino", "cpu")
    backend, device = resolve_device("cpu", backend="torch")
    assert (backend.name, device) == ("torch", "cpu")


def test_auto_picks_cpu_here(monkeypatch):
    monkeypatch.delenv("XPUSPEC_DEVICE", raising=False)
    assert resolve_device()[1] == "cpu"


def test_absent_npu_names_the_devices_that_exist(monkeypatch):
    monkeypatch.setenv("XPUSPEC_DEVICE", "npu")
    with pytest.raises(DeviceNotFoundError, match=r"'npu' is not available.*Available: cpu \(openvino\)") as info:
        resolve_device()
    # an installed backend that failed to load is named with its reason (here: ipex without its package), so a
    # user whose plugins point at a deleted checkout learns why no device is found
    assert "Installed backends that cannot run here: ipex:" in str(info.value)
    assert "intel_extension_for_pytorch" in str(info.value)


def test_typo_suggests_the_closest_device():
    with pytest.raises(DeviceNotFoundError, match="Did you mean 'cpu'"):
        resolve_device("cpuu")


def test_device_list_is_refused_where_one_device_is_needed():
    with pytest.raises(DeviceNotFoundError, match="names pipeline stages"):
        resolve_device("cpu,cpu")
