"""Low-bit policy: formats, aliases, group-size fitting and NPU rules (pure functions)."""

import logging

import pytest

from xpuspec import LowBitConfig, LowBitConfigError
from xpuspec.lowbit import resolve_low_bit

SMOLLM2_CHANNELS = [576, 1536, 576]  # hidden, MLP intermediate, heads x head_dim


def test_aliases_keep_their_meaning():
    assert resolve_low_bit(load_in_4bit=True).format == "int4_asym"
    assert resolve_low_bit(load_in_8bit=True).format == "int8_asym"
    assert resolve_low_bit("INT4_SYM", group_size=64).group_size == 64
    assert resolve_low_bit() is None


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(load_in_low_bit="int3"), "Unknown low-bit format 'int3'"),
    (dict(load_in_4bit=True, load_in_8bit=True), "only one of"),
    (dict(group_size=64), "without a low-bit format"),
    (dict(load_in_low_bit="int8_asym", group_size=64), "applies to INT4 only"),
    (dict(load_in_low_bit="int4_asym", ratio=1.5), "ratio must be in (0, 1]"),
    (dict(load_in_low_bit="int4_asym", group_size=0), "positive integer or -1"),
])
def test_bad_settings_are_refused(kwargs, phrase):
    with pytest.raises(LowBitConfigError, match=phrase.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        resolve_low_bit(**kwargs)


def test_group_size_fitted_to_smollm2_channels(caplog):
    with caplog.at_level(logging.DEBUG, logger="xpuspec"):
        fitted = LowBitConfig("int4_asym").fitted(SMOLLM2_CHANNELS)
    assert fitted.group_size == 64  # 576 = 64 x 9 is not a multiple of 128
    assert len([r for r in caplog.records if "does not divide" in r.message]) == 1


def test_group_size_kept_when_it_divides():
    assert LowBitConfig("int4_sym", group_size=32).fitted(SMOLLM2_CHANNELS).group_size == 32
    assert LowBitConfig("int4_sym").fitted([896, 4864]).group_size == 128


def test_channel_wise_when_nothing_divides():
    assert LowBitConfig("int4_asym").fitted([100, 200]).group_size == -1


def test_npu_rules():
    with pytest.raises(LowBitConfigError, match="symmetric"):
        LowBitConfig("int4_asym").fitted(SMOLLM2_CHANNELS, device="npu")
    with pytest.raises(LowBitConfigError, match="group size 128 or -1"):
        LowBitConfig("int4_sym", group_size=64).fitted(SMOLLM2_CHANNELS, device="npu")
    # 128 does not divide 576, and NPU allows no 64: channel-wise.
    assert LowBitConfig("int4_sym").fitted(SMOLLM2_CHANNELS, device="npu").group_size == -1
    assert LowBitConfig("int8_asym").fitted(SMOLLM2_CHANNELS, device="npu").format == "int8_asym"
