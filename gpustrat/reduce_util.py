"""``ReduceOp``: how values from several replicas combine into one."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """Reduction over replicas. Strings ``"sum"``, ``"mean"``, ``"max"``, ``"min"``
    (any case) are accepted wherever a ReduceOp is."""

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"

    @staticmethod
    def from_value(op) -> "ReduceOp":
        found = OPS_BY_KEY.get(op if type(op) is str else id(op))
        if found is not None:
            return found
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return ReduceOp[op.strip().upper()]
            except KeyError:
                pass
        raise ValueError(
            f"unknown reduce op {op!r}: use ReduceOp.SUM, MEAN, MAX or MIN "
            "(or the strings 'sum', 'mean', 'max', 'min')")


#: The ops by ``id(op)`` and by name (upper and lower case), looked up without running
#: Python code: hashing an Enum member calls its Python ``__hash__``, an id does not.
#: Other spellings go through :meth:`ReduceOp.from_value`.
OPS_BY_KEY = {**{id(op): op for op in ReduceOp},
              **{k: op for op in ReduceOp for k in (op.name, op.name.lower())}}
