"""The tree of states: parallel alternatives (explore), a checkpoint's variables, diffs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from ._errors import ForkboxError, error_from
from ._types import ExecResult

Keep = Union[str, Sequence[int]]


@dataclass
class Branch:
    """One alternative of an explore: its result, or the error its exec failed with (not raised)."""

    index: int
    #: The kept branch's session id (None: the branch was dropped).
    session_id: str | None
    result: ExecResult | None
    error: ForkboxError | None = None

    @property
    def checkpoint(self) -> int | None:
        """The kept branch's new checkpoint."""
        return self.result.checkpoint if self.result is not None else None


@dataclass
class Explored:
    """The branches of an explore, in the order of the codes."""

    #: The checkpoint every branch started from (None: the template).
    from_checkpoint: int | None
    branches: list[Branch] = field(default_factory=list)
    total_time_ms: float = 0.0

    def __iter__(self):
        return iter(self.branches)

    def __len__(self) -> int:
        return len(self.branches)

    def __getitem__(self, i: int) -> Branch:
        return self.branches[i]


@dataclass
class Variable:
    name: str
    type: str
    repr: str
    size: int
    len: int | None = None

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> Variable:
        return cls(str(v.get("name", "")), str(v.get("type", "")), str(v.get("repr", "")), int(v.get("size") or 0), v.get("len"))


def explore_body(codes: Sequence[str], checkpoint: int | None, keep: Keep, timeout: float | None) -> dict[str, Any]:
    if isinstance(codes, str):
        raise TypeError("codes: a list of code strings, not one string")
    body: dict[str, Any] = {"codes": list(codes)}
    if checkpoint is not None:
        body["checkpoint"] = checkpoint
    if isinstance(keep, str):
        if keep not in ("none", "all"):
            raise ValueError('keep: "none", "all" or a list of indices')
        body["keep"] = keep
    else:
        body["keep"] = [int(i) for i in keep]
    if timeout is not None:
        body["timeout_seconds"] = timeout
    return body


def explored(v: dict[str, Any]) -> Explored:
    out = Explored(v.get("from"), [], float(v.get("total_time_ms") or 0.0))
    for b in v.get("branches") or []:
        if b.get("result") is not None:
            out.branches.append(Branch(int(b["index"]), b.get("session"), ExecResult.from_json(b["result"])))
        else:
            failed = b.get("failed") or {}
            err = error_from(int(failed.get("status") or 0), failed)
            out.branches.append(Branch(int(b["index"]), b.get("session"), None, err))
    return out


def variables(v: dict[str, Any]) -> list[Variable]:
    return [Variable.from_json(x) for x in v.get("variables") or []]


def diff_params(a: int, b: int | None) -> dict[str, int]:
    p = {"from": int(a)}
    if b is not None:
        p["to"] = int(b)
    return p
