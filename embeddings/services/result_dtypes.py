"""How a job's vectors are stored in the job store, and what each stored value costs in bytes.

Only float32 here; the float16 part of issue 13 adds float16 (this module's names stay).
"""

from __future__ import annotations

import numpy as np

FLOAT32 = "float32"
DEFAULT_RESULT_DTYPE = FLOAT32
# The names clients and admins use, and each one's little-endian storage dtype.
RESULT_DTYPES: dict[str, np.dtype] = {FLOAT32: np.dtype("<f4")}


def result_storage_dtype(name: str) -> np.dtype:
    try:
        return RESULT_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown result dtype {name!r}; one of {', '.join(RESULT_DTYPES)}") from None


def result_bytes_per_value(name: str) -> int:
    """Bytes one stored vector component takes: a job's results cost inputs x dimensions x this."""
    return result_storage_dtype(name).itemsize
