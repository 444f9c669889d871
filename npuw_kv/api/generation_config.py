"""``GenerationConfig``: every field of ``openvino_genai.GenerationConfig``, honoured or refused,
with its methods (``validate``, ``update_generation_config``, ``set_eos_token_id``, the ``is_*``
predicates) and its constructor from a ``generation_config.json``.

Fields and defaults are genai's (2026.4), its "unset" sentinels included: ``eos_token_id`` -1,
``max_new_tokens`` / ``max_length`` / ``no_repeat_ngram_size`` / ``top_k`` SIZE_MAX (``None``
is taken for them too), ``stop_criteria`` a ``StopCriteria``.  As in genai, types are
checked when a config is built and values by :meth:`GenerationConfig.validate`, which every
``generate`` call runs before any work (:mod:`.config_checks`); a field we cannot honour is
refused there by name, so nothing is silently dropped.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..errors import UsageError
from .config_checks import SIZE_MAX, check_values, limit, normalize
from .config_file import read_generation_config


@dataclass(init=False)
class GenerationConfig:
    """Per-call generation settings, named and defaulted as ``openvino_genai.GenerationConfig``."""

    # stop conditions
    # SIZE_MAX (or None, given): until a stop or the KV cache / context is full
    max_new_tokens: int = SIZE_MAX
    max_length: int = SIZE_MAX  # prompt + new tokens; max_new_tokens wins when both are set
    min_new_tokens: int = 0  # stop tokens are masked until this many tokens are generated
    ignore_eos: bool = False  # no stop token (EOS or stop_token_ids) ends generation
    eos_token_id: int = -1  # -1: unset; also one of stop_token_ids (merged, as genai does)
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
    no_repeat_ngram_size: int = SIZE_MAX  # n: no n-gram of prompt + output twice
    # multinomial sampling
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = SIZE_MAX  # SIZE_MAX or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    rng_seed: int | None = 0  # None: fresh OS entropy on each call
    structured_output_config: Any = None  # honoured through decode's ``constraint``
    # beam search (npuw_kv/generation/beam_search.py)
    num_beams: int = 1
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    length_penalty: float = 1.0
    stop_criteria: Any = "HEURISTIC"  # an openvino_genai.StopCriteria (or its name, given)
    # assisted generation: honoured by a pipeline made with prompt_lookup=True or
    # draft_model=, refused by any other (npuw_kv/generation/speculative.py)
    num_assistant_tokens: int | None = None
    max_ngram_size: int = 0
    assistant_confidence_threshold: float = 0.0
    # tree search: a draft's tree of candidates (npuw_kv/generation/draft_tree.py)
    tree_depth: int = 0
    branching_factor: int = 1
    adapters: Any = None
    # these four: refused off their defaults (config_checks)
    parsers: list[Any] = field(default_factory=list)
    return_omni_outputs: bool = False
    pruning_ratio: int = 0
    relevance_weight: float = 0.5

    def __init__(self, json_path: str | os.PathLike[str] | None = None, /, **kwargs: Any) -> None:
        """Fields by keyword, as genai's; or a ``generation_config.json`` first (genai's
        ``GenerationConfig(json_path)``), the keywords over what it sets."""
        values = read_generation_config(json_path) if json_path is not None else {}
        values.update(kwargs)
        names = {f.name for f in fields(self)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise UsageError(f"unknown generation setting(s) {unknown}; known: {sorted(names)}")
        for f in fields(self):
            if f.name in values:
                value = values[f.name]
            elif f.default is not MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[operator]
            setattr(self, f.name, value)
        normalize(self)

    # -- genai's methods ------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise a ``UsageError`` (a ``RuntimeError`` too, as genai's) naming what cannot run;
        the types of fields set since the config was built are checked too."""
        normalize(self, merge_eos=False)
        check_values(self)

    def update_generation_config(self, **kwargs: Any) -> None:
        """Set the named fields (genai's keyword form); an ``eos_token_id`` joins the stop
        tokens, as in genai."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UsageError(f"unknown generation setting(s) {unknown}; known: {sorted(known)}")
        for name, value in kwargs.items():
            setattr(self, name, value)
        normalize(self, merge_eos="eos_token_id" in kwargs)

    def set_eos_token_id(self, eos_token_id: int) -> None:
        """The EOS token, also one of ``stop_token_ids``."""
        self.eos_token_id = eos_token_id
        normalize(self)

    def is_beam_search(self) -> bool:
        return self.num_beams > 1

    def is_tree_search(self) -> bool:
        return self.tree_depth > 0

    def is_greedy_decoding(self) -> bool:
        return not self.do_sample and not self.is_beam_search() and not self.is_tree_search()

    def is_multinomial(self) -> bool:
        return self.do_sample

    def is_assisting_generation(self) -> bool:
        return self.assistant_confidence_threshold > 0 or (self.num_assistant_tokens or 0) > 0

    def is_prompt_lookup(self) -> bool:
        return self.max_ngram_size > 0 and (self.num_assistant_tokens or 0) > 0

    def is_structured_output_generation(self) -> bool:
        return self.structured_output_config is not None

    # -- ours -----------------------------------------------------------------------------------
    def stop_ids(self) -> set[int]:
        """Tokens that end generation: ``stop_token_ids`` and ``eos_token_id`` (which the
        pipeline may fill in after building the config)."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id >= 0:
            ids.add(self.eos_token_id)
        return ids

    def new_token_budget(self, prompt_len: int) -> int | None:
        """How many tokens to generate at most (None: no limit), as genai: ``max_new_tokens``
        when set, else ``max_length`` minus the prompt."""
        if limit(self.max_new_tokens) is not None:
            return self.max_new_tokens
        if limit(self.max_length) is None:
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
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def to_genai(self) -> Any:
        """The same settings as an ``openvino_genai.GenerationConfig``."""
        import openvino_genai

        config = openvino_genai.GenerationConfig()
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "rng_seed" and value is None or f.name == "adapters" and not value:
                continue  # genai has no "unseeded": keep its default; no adapters: its None
            try:
                setattr(config, f.name, value)
            except TypeError as exc:
                raise UsageError(f"openvino_genai cannot take {f.name}={value!r}") from exc
        return config
