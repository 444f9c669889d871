"""One configuration's accuracy figures against the reference (a row of the matrix)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Result:
    prompt_len: int
    device: str
    mode: str
    chunk: int
    new_tokens: int
    matched: int = 0
    first_divergence: int | None = None
    max_abs_dlogit: float = float("nan")
    mean_kl: float = float("nan")
    ppl: float = float("nan")
    ppl_ref: float = float("nan")
    # where the paths part, how far the reference's logit for its token is ahead of its logit
    # for the token chosen instead: an error that size flips it, so a small lead marks a
    # near-tie, not a defect
    ref_margin: float = float("nan")
    retrieval_found: bool | None = None
    tolerance: float | None = None
    error: str | None = None
    passed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.device}/{self.mode}/C{self.chunk}/{self.prompt_len}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}
