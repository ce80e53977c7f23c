"""Every example config in examples/ is a valid RunConfig; a typo names the field."""

from pathlib import Path

import pytest

from rolledger.schemas.config import ConfigError, RunConfig

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_load(path: Path) -> None:
    RunConfig.load(path)


def test_a_misspelt_field_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[admission]\nmax_queued_byte = 10\n")
    with pytest.raises(
        ConfigError, match=r"bad\.toml: admission\.max_queued_byte: unknown field; did you mean max_queued_bytes\?$"
    ):
        RunConfig.load(bad)  # one line naming the file and the field, and the closest valid one
