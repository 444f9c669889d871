"""What a :class:`~npuw_kv.api.generation_config.GenerationConfig` may hold, in two steps as in
openvino-genai: its types when it is built (:func:`normalize`), its values when it is validated
(:func:`check_values`, which every ``generate`` call runs before any work).

genai's ``validate()`` rules come first and in its order; after them the ones that are ours:
finite numbers, a confidence threshold in [0, 1], and fields we cannot honour refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import UsageError
from .adapters import adapter_config

SIZE_MAX = 2**64 - 1  # genai's "unset" for its size_t fields
INT64_MAX = 2**63 - 1
UNSET_IS_SIZE_MAX = ("max_new_tokens", "max_length", "no_repeat_ngram_size")
# genai's size_t fields: a negative value is a type error, as in genai
UNSIGNED = (
    "max_new_tokens", "max_length", "min_new_tokens", "no_repeat_ngram_size", "rng_seed", "top_k",
    "logprobs", "num_return_sequences", "num_beams", "num_beam_groups", "num_assistant_tokens",
    "max_ngram_size", "tree_depth", "branching_factor",
)  # fmt: skip
# size_t fields whose whole range a program may set (genai's SIZE_MAX sentinels among them)
_FULL_RANGE = (*UNSET_IS_SIZE_MAX, "rng_seed", "top_k")
BOOLS = ("do_sample", "ignore_eos", "apply_chat_template", "echo", "include_stop_str_in_output")
NUMBERS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "length_penalty", "diversity_penalty", "assistant_confidence_threshold",
)  # fmt: skip
# field -> (its default, why a non-default value is refused)
REFUSED: dict[str, tuple[Any, str]] = {
    "parsers": ([], "output parsers are not supported: run the parser on the result's text"),
    "return_omni_outputs": (False, "omni (speech) outputs need openvino_genai's omni pipeline"),
    "pruning_ratio": (0, "CDPruner visual-token pruning is for vision-language pipelines"),
    "relevance_weight": (0.5, "CDPruner visual-token pruning is for vision-language pipelines"),
}


# -- types, when the config is built ----------------------------------------------------------
def normalize(config: Any, merge_eos: bool = True) -> None:
    """Check each field's type and bring it to its canonical form (genai's SIZE_MAX and -1
    "unset" to None, sets copied); ``merge_eos``: put ``eos_token_id`` among
    ``stop_token_ids``, as genai's constructor does (its ``validate()`` does not)."""
    for name in BOOLS:
        value = getattr(config, name)
        if not isinstance(value, (bool, np.bool_)):
            raise UsageError(f"{name} must be True or False, got {value!r}")
        setattr(config, name, bool(value))
    for name in UNSIGNED:
        value = getattr(config, name)
        if name in UNSET_IS_SIZE_MAX and value is None:
            value = SIZE_MAX  # genai's "unset", which a program reads back
        if value is not None or name not in ("rng_seed", "num_assistant_tokens"):
            value = _integer(name, value, 0, SIZE_MAX if name in _FULL_RANGE else INT64_MAX)
        setattr(config, name, value)
    if config.eos_token_id is None:
        config.eos_token_id = -1  # genai's "unset"
    config.eos_token_id = _integer("eos_token_id", config.eos_token_id, -1, INT64_MAX)
    for name in NUMBERS:
        value = getattr(config, name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise UsageError(f"{name} must be a number, got {value!r}")
        setattr(config, name, float(value))
    config.stop_strings = _string_set(config.stop_strings)
    config.stop_token_ids = _id_set(config.stop_token_ids)
    if merge_eos and config.eos_token_id >= 0:
        config.stop_token_ids.add(config.eos_token_id)
    config.stop_criteria = _criteria(config.stop_criteria)
    config.parsers = list(config.parsers or [])  # sets and lists are copies: none shared
    config.adapters = adapter_config(config.adapters)  # ours; genai's cannot be read


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise UsageError(f"{name} must be >= {low}, got {value}")
    if value > high:  # what genai's C++ field holds
        raise UsageError(f"{name} must be <= {high}, got {value}")
    return int(value)


def _string_set(stops: Any) -> set[str]:
    stops = {stops} if isinstance(stops, str) else stops
    try:
        stops = set(stops)
    except TypeError:
        raise UsageError(f"stop_strings must be a set of strings, got {stops!r}") from None
    if not all(isinstance(stop, str) for stop in stops):
        raise UsageError(f"stop_strings must be strings, got {sorted(map(repr, stops))}")
    for stop in stops:
        try:
            stop.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no text can contain it
            raise UsageError(
                f"stop string {stop!r} is not valid Unicode ({exc.reason} at character {exc.start})"
            ) from None
    return stops


def _id_set(ids: Any) -> set[int]:
    ids = {ids} if isinstance(ids, (int, np.integer)) else ids
    try:
        ids = set(ids)
    except TypeError:
        raise UsageError(f"stop_token_ids must be a set of token ids, got {ids!r}") from None
    bad = [
        i
        for i in ids
        if isinstance(i, bool)
        or not isinstance(i, (int, np.integer))
        or not -INT64_MAX - 1 <= i <= INT64_MAX
    ]
    if bad:
        raise UsageError(f"stop_token_ids must be token ids (64-bit integers), got {bad[0]!r}")
    return {int(i) for i in ids}


def _criteria(value: Any) -> Any:
    """genai's ``StopCriteria`` member for ``value`` (the member, or its name)."""
    from openvino_genai import StopCriteria

    name = getattr(value, "name", value)
    if not isinstance(name, str) or name.upper() not in StopCriteria.__members__:
        raise UsageError(f"stop_criteria must be EARLY, HEURISTIC or NEVER, got {value!r}")
    return StopCriteria.__members__[name.upper()]


def limit(value: int) -> int | None:
    """A size_t limit as a number, None where genai's sentinel (SIZE_MAX) says unset."""
    return None if value == SIZE_MAX else value


# -- values, when the config is validated -----------------------------------------------------
def check_values(config: Any) -> None:
    """Refuse, by name, a config that cannot be run (genai's ``validate()``, then ours)."""
    _check_stops(config)
    _check_penalties(config)
    if config.do_sample:
        _check_sampling(config)
    if config.num_beams > 1:
        _check_beams(config)
    elif config.num_beams < 1:
        raise UsageError(f"num_beams must be >= 1, got {config.num_beams}")
    _check_assisted(config)
    if config.tree_depth > 0:
        _check_tree(config)
    for name, (default, why) in REFUSED.items():
        value = getattr(config, name)
        if value != default:
            raise UsageError(f"{name}={value!r} is not supported: {why}")


def _check_stops(config: Any) -> None:
    if config.num_return_sequences < 1:
        raise UsageError(f"num_return_sequences must be >= 1, got {config.num_return_sequences}")
    eos, stops = config.eos_token_id, config.stop_token_ids
    if eos >= 0 and eos not in stops:
        raise UsageError(
            f"stop_token_ids {sorted(stops)} must contain eos_token_id ({eos}): set it with "
            "set_eos_token_id()"
        )
    negative = sorted(i for i in stops if i < 0)
    if negative:
        raise UsageError(f"stop_token_ids must be >= 0, got {negative[0]}")
    if "" in config.stop_strings:
        raise UsageError("stop_strings must be non-empty strings, got ''")
    limited = limit(config.max_new_tokens) is not None or limit(config.max_length) is not None
    if config.ignore_eos and not limited:
        raise UsageError("ignore_eos=True needs max_new_tokens or max_length")
    if not (limited or stops or config.stop_strings):
        raise UsageError(
            "no stop condition: set max_new_tokens, max_length, eos_token_id, stop_token_ids "
            "or stop_strings"
        )
    if limit(config.max_new_tokens) is not None:
        if config.max_new_tokens == 0 and not config.echo:
            raise UsageError("max_new_tokens must be > 0 (0 only with echo=True)")
        if config.min_new_tokens > config.max_new_tokens:
            raise UsageError(
                f"min_new_tokens ({config.min_new_tokens}) must be <= max_new_tokens "
                f"({config.max_new_tokens})"
            )
    if config.num_return_sequences > 1 and not config.do_sample and config.num_beams == 1:
        raise UsageError(
            f"num_return_sequences={config.num_return_sequences} needs do_sample=True "
            "(independent samples) or num_beams > 1 (beam search)"
        )


def _check_penalties(config: Any) -> None:
    for name in NUMBERS:  # NaN or inf would sample nonsense (or nothing) silently
        if not np.isfinite(getattr(config, name)):
            raise UsageError(f"{name} must be a finite number, got {getattr(config, name)!r}")
    if config.num_beams > 1:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(config, name) != (1.0 if name == "repetition_penalty" else 0.0):
                raise UsageError(f"{name} is not supported by beam search (as in genai)")
        return
    if config.repetition_penalty <= 0:
        raise UsageError(f"repetition_penalty must be > 0, got {config.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(config, name) <= 2:
            raise UsageError(f"{name} must be in [-2, 2], got {getattr(config, name)}")


def _check_sampling(config: Any) -> None:
    """The multinomial fields, which only sampling reads (as genai, unchecked otherwise)."""
    if not 0 < config.top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1] when sampling, got {config.top_p}")
    if config.temperature <= 0:
        raise UsageError(f"temperature must be > 0 when sampling, got {config.temperature}")
    if not 0 <= config.min_p < 1:
        raise UsageError(f"min_p must be in [0, 1) when sampling, got {config.min_p}")


def _check_beams(config: Any) -> None:
    """Beam search's fields (npuw_kv/generation/beam_search.py), which only it reads."""
    beams, groups = config.num_beams, config.num_beam_groups
    if config.do_sample:
        raise UsageError(f"num_beams={beams} (beam search) cannot sample: set do_sample=False")
    if groups < 1 or beams % groups:
        raise UsageError(f"num_beams ({beams}) must be divisible by num_beam_groups ({groups})")
    if config.num_return_sequences > beams:
        raise UsageError(
            f"num_return_sequences ({config.num_return_sequences}) must be <= num_beams ({beams})"
        )
    if config.no_repeat_ngram_size == 0:
        raise UsageError("no_repeat_ngram_size must be positive in beam search")
    if (groups > 1) != (config.diversity_penalty != 0):
        raise UsageError(
            "diversity_penalty applies between beam groups: set it != 0 with "
            f"num_beam_groups > 1 and 0 otherwise (got {config.diversity_penalty}, "
            f"num_beam_groups={groups})"
        )


def _check_tree(config: Any) -> None:
    """Tree search's fields (genai's rules; npuw_kv/generation/draft_tree.py)."""
    if config.do_sample:
        raise UsageError("tree search (tree_depth > 0) cannot sample: set do_sample=False")
    if config.num_beams != 1:
        raise UsageError("tree search (tree_depth > 0) is not beam search: set num_beams=1")
    if config.branching_factor < 1:
        raise UsageError("branching_factor must be > 0 when tree_depth > 0")
    tokens = config.num_assistant_tokens or 0
    if tokens < config.tree_depth:
        raise UsageError(
            f"num_assistant_tokens ({tokens}) must be >= tree_depth ({config.tree_depth}): "
            "at least one node per layer of the tree"
        )


def _check_assisted(config: Any) -> None:
    tokens = config.num_assistant_tokens or 0
    threshold = config.assistant_confidence_threshold
    if not 0 <= threshold <= 1:
        raise UsageError(f"assistant_confidence_threshold must be in [0, 1], got {threshold}")
    if tokens > 0 or threshold > 0:
        if config.num_beams > 1 or config.num_return_sequences > 1:
            raise UsageError(
                "assisted generation (num_assistant_tokens / assistant_confidence_threshold) "
                "runs one sequence: not with num_beams > 1 or num_return_sequences > 1"
            )
        if tokens > 0 and threshold > 0:
            raise UsageError(
                "num_assistant_tokens and assistant_confidence_threshold exclude each other: "
                "set one"
            )
    if tokens == 0 and config.max_ngram_size:
        raise UsageError(
            f"max_ngram_size={config.max_ngram_size} is for prompt lookup, which needs "
            "num_assistant_tokens > 0"
        )
