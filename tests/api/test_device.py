"""Devices: specs, the default device, availability, and bad input."""

from __future__ import annotations

import dataclasses

import pytest

import aiostream as ais


def test_device_is_frozen_hashable_and_prints_as_kind_index() -> None:
    d = ais.Device("virtual", 0)
    assert str(d) == "virtual:0"
    assert d == ais.Device("virtual", 0)
    assert hash(d) == hash(ais.Device("virtual", 0))
    assert {d: 1}[ais.Device("virtual", 0)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.index = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        (("tpu", 0), ValueError, "'cuda', 'virtual'"),
        (("virtual", -1), ValueError, ">= 0"),
        (("virtual", "0"), TypeError, "index must be an int"),
        (("virtual", True), TypeError, "index must be an int"),
    ],
)
def test_device_rejects_bad_fields(args: tuple, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        ais.Device(*args)


def test_device_specs() -> None:
    ais.virtual.reset(devices=2)
    assert ais.device("virtual") == ais.Device("virtual", 0)
    assert ais.device("virtual:1") == ais.Device("virtual", 1)
    assert ais.device(ais.Device("virtual", 1)) == ais.Device("virtual", 1)


def test_default_device_is_virtual_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOSTREAM_DEVICE", raising=False)
    if ais.is_available("cuda"):
        assert ais.device() == ais.Device("cuda", 0)
    else:
        assert ais.device() == ais.Device("virtual", 0)


def test_default_device_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    ais.virtual.reset(devices=2)
    monkeypatch.setenv("AIOSTREAM_DEVICE", "virtual:1")
    assert ais.device() == ais.Device("virtual", 1)
    assert ais.Stream().device == ais.Device("virtual", 1)
    monkeypatch.setenv("AIOSTREAM_DEVICE", "gpu")
    with pytest.raises(ValueError, match="AIOSTREAM_DEVICE='gpu'"):
        ais.device()


@pytest.mark.parametrize("spec", ["gpu", "gpu:0", "virtual:x", "virtual:", "virtual:-1", ":0", ""])
def test_bad_specs_name_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="'virtual:N', 'cuda' or 'cuda:N'"):
        ais.device(spec)


@pytest.mark.parametrize("spec", [0, 1.0, b"virtual", ["virtual"]])
def test_wrong_types_are_type_errors(spec: object) -> None:
    with pytest.raises(TypeError, match="got"):
        ais.device(spec)  # type: ignore[arg-type]


def test_index_past_the_count_says_how_many() -> None:
    with pytest.raises(ValueError, match="has 1 device"):
        ais.device("virtual:1")
    ais.virtual.reset(devices=3)
    with pytest.raises(ValueError, match=r"has 3 devices \(virtual:0 to virtual:2\)"):
        ais.device("virtual:3")


def test_availability_and_counts() -> None:
    assert ais.is_available("virtual")
    assert ais.device_count("virtual") == 1
    ais.virtual.reset(devices=4)
    assert ais.device_count("virtual") == 4
    assert isinstance(ais.is_available("cuda"), bool)
    with pytest.raises(ValueError, match="kind must be one of"):
        ais.is_available("tpu")
    with pytest.raises(TypeError, match="kind must be a str"):
        ais.device_count(0)  # type: ignore[arg-type]


def test_unavailable_cuda_says_why() -> None:
    if ais.is_available("cuda"):
        pytest.skip("CUDA works here; this checks the message given where it does not")
    assert ais.device_count("cuda") == 0
    with pytest.raises(ais.BackendUnavailableError, match="'cuda' backend is unavailable") as info:
        ais.Stream("cuda:0")
    assert info.value.kind == "cuda"
    assert info.value.reason
    assert isinstance(info.value, ais.AiostreamError)
