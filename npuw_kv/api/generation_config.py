"""``GenerationConfig``: every field of ``openvino_genai.GenerationConfig``, honoured or refused.

Fields and defaults are genai's (2026.4), with genai's "unset" sentinels as ``None``
(``eos_token_id`` -1, ``max_new_tokens`` / ``max_length`` / ``no_repeat_ngram_size`` SIZE_MAX)
and ``top_k`` 0 for "off" (genai's SIZE_MAX and 0 both mean off).  A field we cannot honour
raises a ``ValueError`` naming it when it leaves its default, so nothing is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..errors import UsageError
from .adapters import adapter_config

SIZE_MAX = 2**64 - 1  # genai's "unset" for its size_t fields
_UNSET_IS_SIZE_MAX = ("max_new_tokens", "max_length", "no_repeat_ngram_size")

_TREE = "tree search (EAGLE speculative decoding) is not implemented"
# field -> (its default, why a non-default value is refused)
_REFUSED: dict[str, tuple[Any, str]] = {
    "tree_depth": (0, _TREE),
    "branching_factor": (1, _TREE),
    "parsers": ([], "output parsers are not supported: run the parser on the result's text"),
    "return_omni_outputs": (False, "omni (speech) outputs need openvino_genai's omni pipeline"),
    "pruning_ratio": (0, "CDPruner visual-token pruning is for vision-language pipelines"),
    "relevance_weight": (0.5, "CDPruner visual-token pruning is for vision-language pipelines"),
}


# float fields: numbers, and finite
_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "diversity_penalty",
    "assistant_confidence_threshold",
)


@dataclass
class GenerationConfig:
    """Per-call generation settings, named and defaulted as ``openvino_genai.GenerationConfig``."""

    # stop conditions
    max_new_tokens: int | None = None  # None: until a stop or the KV cache / context is full
    max_length: int | None = None  # prompt + new tokens; max_new_tokens wins when both are set
    min_new_tokens: int = 0  # stop tokens are masked until this many tokens are generated
    ignore_eos: bool = False  # no stop token (EOS or stop_token_ids) ends generation
    eos_token_id: int | None = None  # also one of stop_token_ids (merged, as genai does)
    stop_token_ids: set[int] = field(default_factory=set)
    stop_strings: set[str] = field(default_factory=set)
    include_stop_str_in_output: bool = False
    # output
    echo: bool = False  # the result's text starts with the prompt's
    logprobs: int = 0  # > 0: raw log-probs in the result, with this many top candidates
    num_return_sequences: int = 1  # > 1: that many independent samples (do_sample only)
    apply_chat_template: bool = True  # text prompts go through the chat template (as genai)
    # penalties
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # tokens generated so far, once each
    frequency_penalty: float = 0.0  # tokens generated so far, per occurrence
    no_repeat_ngram_size: int | None = None  # n: no n-gram of prompt + output twice
    # multinomial sampling
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    rng_seed: int | None = 0  # None: fresh OS entropy on each call
    structured_output_config: Any = None  # honoured through decode's ``constraint``
    # refused when not at their defaults (see _REFUSED)
    num_beams: int = 1
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    length_penalty: float = 1.0
    stop_criteria: str = "heuristic"  # or an openvino_genai.StopCriteria
    # assisted generation: honoured by a pipeline made with prompt_lookup=True or
    # draft_model=, refused by any other (npuw_kv/generation/speculative.py)
    num_assistant_tokens: int | None = None
    max_ngram_size: int = 0
    assistant_confidence_threshold: float = 0.0
    tree_depth: int = 0
    branching_factor: int = 1
    adapters: Any = None
    parsers: list[Any] = field(default_factory=list)
    return_omni_outputs: bool = False
    pruning_ratio: int = 0
    relevance_weight: float = 0.5

    def __post_init__(self) -> None:
        for name in ("do_sample", "ignore_eos", "apply_chat_template", "echo"):
            self._check_bool(name)
        self._check_bool("include_stop_str_in_output")
        for name in ("min_new_tokens", "top_k", "logprobs", "num_return_sequences"):
            self._check_int(name, low=1 if name == "num_return_sequences" else 0)
        self._check_int("max_ngram_size", low=0)  # assisted generation (speculative.py)
        self._check_number("assistant_confidence_threshold")
        if self.num_assistant_tokens is not None:
            self._check_int("num_assistant_tokens", low=0)
        if not 0 <= self.assistant_confidence_threshold <= 1:
            raise UsageError(
                "assistant_confidence_threshold must be in [0, 1], got "
                f"{self.assistant_confidence_threshold}"
            )
        for name in ("max_new_tokens", "max_length", "no_repeat_ngram_size", "rng_seed"):
            if getattr(self, name) is not None:
                self._check_int(name, low=0)
        if self.eos_token_id is not None:
            self._check_int("eos_token_id", low=-1)
            if self.eos_token_id == -1:  # genai's "unset"
                self.eos_token_id = None
        for name in _NUMBERS:
            self._check_number(name)
        if self.do_sample and self.temperature <= 0:
            raise UsageError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise UsageError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise UsageError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UsageError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise UsageError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        self._check_beams()
        self.stop_strings = _string_set(self.stop_strings)
        self.stop_token_ids = _id_set(self.stop_token_ids)
        if self.eos_token_id is not None:
            self.stop_token_ids.add(self.eos_token_id)
        self.stop_criteria = _criteria_name(self.stop_criteria)
        self.parsers = list(self.parsers or [])  # sets and lists are copies: none shared
        self.adapters = adapter_config(self.adapters)  # ours; genai's cannot be read
        for name, (default, why) in _REFUSED.items():
            value = getattr(self, name)
            if value != default:
                raise UsageError(f"{name}={value!r} is not supported: {why}")

    def _check_beams(self) -> None:
        """Beam search settings, checked as genai's ``validate`` does (npuw_kv/beam_search)."""
        for name in ("num_beams", "num_beam_groups"):
            self._check_int(name, low=1)
        for name in ("diversity_penalty", "length_penalty"):
            self._check_number(name)
        beams, groups = self.num_beams, self.num_beam_groups
        if groups > beams:
            raise UsageError(f"num_beam_groups ({groups}) must be <= num_beams ({beams})")
        if self.num_return_sequences > 1 and not self.do_sample and beams == 1:
            raise UsageError(
                f"num_return_sequences={self.num_return_sequences} needs do_sample=True "
                "(independent samples) or num_beams > 1 (beam search)"
            )
        if beams == 1:
            return
        if self.do_sample:
            raise UsageError(f"num_beams={beams} (beam search) cannot sample: set do_sample=False")
        if beams % groups:
            raise UsageError(f"num_beams ({beams}) must be divisible by num_beam_groups ({groups})")
        if self.num_return_sequences > beams:
            raise UsageError(
                f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({beams})"
            )
        if (groups > 1) != (self.diversity_penalty != 0):
            raise UsageError(
                "diversity_penalty applies between beam groups: set it != 0 with "
                f"num_beam_groups > 1 and 0 otherwise (got {self.diversity_penalty}, "
                f"num_beam_groups={groups})"
            )
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(self, name) != (1.0 if name == "repetition_penalty" else 0.0):
                raise UsageError(f"{name} is not supported by beam search (as in genai)")
        if self.no_repeat_ngram_size == 0:
            raise UsageError("no_repeat_ngram_size must be positive in beam search")

    def _check_bool(self, name: str) -> None:
        if not isinstance(getattr(self, name), (bool, np.bool_)):
            raise UsageError(f"{name} must be True or False, got {getattr(self, name)!r}")
        setattr(self, name, bool(getattr(self, name)))

    def _check_int(self, name: str, low: int) -> None:
        value = getattr(self, name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise UsageError(f"{name} must be an integer, got {value!r}")
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
        high = _UINT64_MAX if name in _UNSIGNED else _INT64_MAX  # what genai's C++ fields hold
        if value > high:
            raise UsageError(f"{name} must be <= {high}, got {value}")
        setattr(self, name, int(value))

    def _check_number(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise UsageError(f"{name} must be a number, got {value!r}")
        if not np.isfinite(value):  # NaN or inf would sample nonsense (or nothing) silently
            raise UsageError(f"{name} must be a finite number, got {value!r}")

    def stop_ids(self) -> set[int]:
        """Tokens that end generation: ``stop_token_ids`` and ``eos_token_id`` (which the
        pipeline may fill in after building the config)."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    def new_token_budget(self, prompt_len: int) -> int | None:
        """How many tokens to generate at most (None: no limit), as genai: ``max_new_tokens``
        when set, else ``max_length`` minus the prompt."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None:
            return None
        if self.max_length <= prompt_len:
            raise UsageError(
                f"max_length ({self.max_length}) must be greater than the prompt's "
                f"{prompt_len} tokens (or set max_new_tokens)"
            )
        return self.max_length - prompt_len

    @classmethod
    def build(cls, base: Any = None, **kwargs: Any) -> GenerationConfig:
        """``base`` (ours, an ``openvino_genai.GenerationConfig`` or None) updated with
        ``kwargs``; unknown names are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UsageError(f"unknown generation setting(s) {unknown}; known: {sorted(known)}")
        if base is not None and not isinstance(base, GenerationConfig):
            base = cls.from_genai(base)
        values = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        values.update(kwargs)
        return cls(**values)

    @classmethod
    def from_genai(cls, config: Any) -> GenerationConfig:
        """Ours from an ``openvino_genai.GenerationConfig``, field by field."""
        import openvino_genai

        if not isinstance(config, openvino_genai.GenerationConfig):
            raise UsageError(
                "generation_config must be an npuw_kv or openvino_genai GenerationConfig, "
                f"got {type(config).__name__}"
            )
        values = {f.name: getattr(config, f.name) for f in fields(cls)}
        for name in _UNSET_IS_SIZE_MAX:
            if values[name] == SIZE_MAX:
                values[name] = None
        if values["top_k"] == SIZE_MAX:
            values["top_k"] = 0
        return cls(**values)

    def to_genai(self) -> Any:
        """The same settings as an ``openvino_genai.GenerationConfig``."""
        import openvino_genai

        config = openvino_genai.GenerationConfig()
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _UNSET_IS_SIZE_MAX or (f.name, value) == ("top_k", 0):
                value = SIZE_MAX
            elif f.name == "eos_token_id" and value is None:
                value = -1
            elif f.name == "stop_criteria":
                value = openvino_genai.StopCriteria.__members__[value.upper()]
            elif f.name == "rng_seed" and value is None or f.name == "adapters" and not value:
                continue  # genai has no "unseeded": keep its default; no adapters: its None
            try:
                setattr(config, f.name, value)
            except TypeError as exc:
                raise UsageError(f"openvino_genai cannot take {f.name}={value!r}") from exc
        return config


def _string_set(stops: Any) -> set[str]:
    stops = {stops} if isinstance(stops, str) else stops
    try:
        stops = set(stops)
    except TypeError:
        raise UsageError(f"stop_strings must be a set of strings, got {stops!r}") from None
    if not all(isinstance(stop, str) and stop for stop in stops):
        raise UsageError(f"stop_strings must be non-empty strings, got {sorted(map(repr, stops))}")
    return stops


_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
_UNSIGNED = ("rng_seed", "max_new_tokens", "max_length", "no_repeat_ngram_size")  # size_t


def _id_set(ids: Any) -> set[int]:
    ids = {ids} if isinstance(ids, (int, np.integer)) else ids
    try:
        ids = set(ids)
    except TypeError:
        raise UsageError(f"stop_token_ids must be a set of token ids, got {ids!r}") from None
    bad = [
        i
        for i in ids
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i <= _INT64_MAX
    ]
    if bad:
        raise UsageError(f"stop_token_ids must be token ids (integers >= 0), got {bad[0]!r}")
    return {int(i) for i in ids}


def _criteria_name(value: Any) -> str:
    name = getattr(value, "name", value)  # an openvino_genai.StopCriteria, or its name
    if not isinstance(name, str) or name.lower() not in ("early", "heuristic", "never"):
        raise UsageError(f"stop_criteria must be early, heuristic or never, got {value!r}")
    return name.lower()
