"""Small numeric helpers shared by the schema, the data and the engine."""


from __future__ import annotations

from typing import overload

import numpy as np


@overload
def round_up(n: int, multiple: int) -> int: ...


@overload
def round_up(n: np.ndarray, multiple: int) -> np.ndarray: ...


def round_up(n, multiple):
    """The smallest multiple of ``multiple`` that is >= ``n`` (element-wise for an array)."""
    return -(-n // multiple) * multiple

