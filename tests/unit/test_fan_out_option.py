"""The enhanced fan-out option as the functions read it (``SHOAL_ENHANCED_FAN_OUT``)."""

from __future__ import annotations

import pytest
from shoal.core.config import Config, parse_fan_out


def test_off_unless_set() -> None:
    # Given an environment without the option, Then no mapping reads through a consumer
    assert Config.from_env({}).enhanced_fan_out == frozenset()


def test_the_option_names_the_mappings_that_read_through_a_consumer() -> None:
    config = Config.from_env({"SHOAL_ENHANCED_FAN_OUT": " router "})
    assert config.enhanced_fan_out == {"router"}


@pytest.mark.parametrize("raw", ["push", "router,archiver"])
def test_an_unknown_mapping_is_an_error_not_a_silent_off(raw: str) -> None:
    with pytest.raises(ValueError, match="SHOAL_ENHANCED_FAN_OUT"):
        parse_fan_out(raw)
