"""Memory budgets given as ints or strings."""

from __future__ import annotations

import pytest

from seqckpt.planner import parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("64KB", 64_000),
        ("10B", 10),
    ],
)
def test_parses_bytes_and_units(text: object, expected: int) -> None:
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", [0, -1, "0MiB", "-5MiB", "lots", "5 parsecs", "MiB"])
def test_rejects_non_positive_or_unparsable_values(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^seqckpt: memory_budget") as info:
        parse_budget(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [True, 1.5, None, [1]])
def test_rejects_wrong_types(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^seqckpt: memory_budget"):
        parse_budget(bad)
