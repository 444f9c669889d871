"""A model's ``generation_config.json`` (Hugging Face's keys) as GenerationConfig fields, read
as openvino-genai's ``GenerationConfig(json_path)`` reads it: the keys it knows, a list of
``eos_token_id`` as stop tokens (the first one the EOS), ``early_stopping`` as the stop
criteria; other keys are Hugging Face's own and ignored, as genai ignores them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..model.small_file import read_small

# the keys genai reads, each into the field of the same name
KEYS = (
    "max_new_tokens", "max_length", "ignore_eos", "min_new_tokens", "stop_strings",
    "include_stop_str_in_output", "echo", "logprobs", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "num_beam_groups", "num_beams", "diversity_penalty", "length_penalty",
    "num_return_sequences", "no_repeat_ngram_size", "do_sample", "temperature", "top_p", "top_k",
    "min_p", "assistant_confidence_threshold", "num_assistant_tokens", "max_ngram_size",
    "branching_factor", "tree_depth",
)  # fmt: skip
_EARLY_STOPPING = {"never": "never", True: "early", False: "heuristic"}


def read_generation_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields ``path`` sets; a clear error when it cannot be read or is not an object."""
    where = Path(path)
    try:
        data = json.loads(read_small(where).decode("utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read the generation config {where}: {exc.strerror}") from None
    except ValueError as exc:  # not JSON, not UTF-8, not a regular file
        raise UsageError(f"the generation config {where} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"the generation config {where} holds a JSON {type(data).__name__}")
    fields = {key: data[key] for key in KEYS if data.get(key) is not None}
    if "stop_strings" in fields and isinstance(fields["stop_strings"], list):
        fields["stop_strings"] = set(fields["stop_strings"])
    eos = data.get("eos_token_id")
    if isinstance(eos, list):  # several EOS: all stop, the first is the EOS
        fields["stop_token_ids"] = set(eos)
        if eos:
            fields["eos_token_id"] = eos[0]
    elif eos is not None:
        fields["eos_token_id"] = eos
    stopping = data.get("early_stopping")
    if isinstance(stopping, (bool, str)) and stopping in _EARLY_STOPPING:
        fields["stop_criteria"] = _EARLY_STOPPING[stopping]
    return fields
