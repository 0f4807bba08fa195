"""Fixtures of the executor tests; their helpers are superfluid.testing's."""

from __future__ import annotations

import pytest

from superfluid.executor.executor import Executor
from superfluid.testing.executor import make_executor


@pytest.fixture
def ex() -> Executor:
    """An executor over a small fake (vocab 64, max_seq_len 64, page 4)."""
    return make_executor(fault_injection=True)

