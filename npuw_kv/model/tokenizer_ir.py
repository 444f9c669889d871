"""The tokenizer IR without its length cut: openvino-tokenizers bakes a maximum length into
the tokenizer graph (8192 for SmolLM2's), and openvino-genai cuts every longer prompt to it
from the left whatever ``truncation`` says: the chat template's header and the start of a
document vanish without a word.  npuw-kv refuses a prompt over ``MAX_PROMPT_LEN`` itself, with
its real length, so the tokenizer must give every token: the cut's limit is raised to the
largest value its type holds, in memory (the files are not changed).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai

_SMALLEST_CUT = 256  # a Minimum against a constant this large or larger is a length cut


def length_cuts(model: ov.Model) -> list[ov.Node]:
    """The ``Minimum(length, limit)`` nodes of a tokenizer graph whose limit is a constant
    scalar length (the truncation)."""
    cuts = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Minimum":
            continue
        limit = node.input(1).get_source_output().get_node()
        if limit.get_type_name() != "Constant":
            continue
        value = np.asarray(limit.get_data())
        if (
            value.size == 1
            and value.dtype.kind == "i"
            and int(value.reshape(-1)[0]) >= _SMALLEST_CUT
        ):
            cuts.append(node)
    return cuts


def untruncated_tokenizer(
    model_dir: Path,
    original: openvino_genai.Tokenizer,
    properties: Mapping[str, Any] | None = None,
) -> openvino_genai.Tokenizer | None:
    """openvino-genai's tokenizer of ``model_dir`` (``original``, loaded from it) with its
    length cut lifted (None: the graph has no cut we know, or it could not be rebuilt, which
    is warned about); compiled with ``properties`` as the original was."""
    xml, detok = model_dir / "openvino_tokenizer.xml", model_dir / "openvino_detokenizer.xml"
    if not xml.is_file() or not detok.is_file():
        return None
    try:
        import openvino_tokenizers  # noqa: F401 - registers the tokenizer operations

        model = ov.Core().read_model(str(xml))
        cuts = length_cuts(model)
        if not cuts:
            return None
        # the special ids genai reads from the directory's config files: kept in the rebuilt
        # tokenizer's own rt_info, where genai also looks for them
        for key, value in (
            ("eos_token_id", original.get_eos_token_id()),
            ("bos_token_id", original.get_bos_token_id()),
            ("pad_token_id", original.get_pad_token_id()),
        ):
            if value >= 0:
                model.set_rt_info(int(value), key)
        for node in cuts:
            dtype = np.asarray(node.input(1).get_source_output().get_node().get_data()).dtype
            shape = node.input(1).get_partial_shape().to_shape()
            unlimited = ov.opset13.constant(np.full(list(shape), np.iinfo(dtype).max, dtype))
            node.input(1).replace_source_output(unlimited.output(0))
        with tempfile.TemporaryDirectory() as tmp:
            ov.save_model(model, f"{tmp}/tokenizer.xml", compress_to_fp16=False)
            text = Path(f"{tmp}/tokenizer.xml").read_text(encoding="utf-8")
            weights = np.fromfile(f"{tmp}/tokenizer.bin", np.uint8)
        return openvino_genai.Tokenizer(
            text,
            ov.Tensor(weights),
            detok.read_text(encoding="utf-8"),
            ov.Tensor(np.fromfile(detok.with_suffix(".bin"), np.uint8)),
            **(properties or {}),
        )
    except (RuntimeError, OSError, ImportError) as exc:
        warnings.warn(
            f"could not lift the tokenizer's length cut ({exc}); prompts longer than it are "
            "cut from the left by the tokenizer",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
