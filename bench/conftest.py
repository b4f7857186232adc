"""Shared set-up of the benchmark suite: one thread on CPU, so ratios measured on
a shared machine are not disturbed by the thread pool."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
