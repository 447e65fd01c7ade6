"""The product's number formats (webapp.units): bytes in binary units read as numbers at
every size (a passage's KV of 1,034,000 bytes showed as "1.01e+03 KiB", issue #49)."""

from __future__ import annotations

import pytest

from webapp.units import bandwidth, count, kib


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "—"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (23_040, "22.5 KiB"),
        (1_022_976, "999 KiB"),
        (1_034_000, "1,010 KiB"),  # three significant digits wrote 1.01e+03
        (1_048_000, "1,023 KiB"),
        (2**20, "1 MiB"),
        (1_800_000, "1.72 MiB"),
        (1023.9 * 2**30, "1,024 GiB"),
        (3 * 2**40, "3 TiB"),
    ],
)
def test_bytes_in_binary_units_never_in_exponent_form(value, shown) -> None:
    assert kib(value) == shown


def test_bandwidth_and_counts() -> None:
    assert bandwidth(1_034_000) == "1,010 KiB/s"
    assert bandwidth(0) == "—"
    assert count(3140) == "3,140"
