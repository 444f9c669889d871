"""A SentencePiece tokenizer rebuilt from a GGUF's own metadata, and its OpenVINO IRs.

transformers' GGUF loader gets some tokenizers wrong (Gemma 3 270M's comes out
character-level and without ``<bos>``), so the tokenizer is rebuilt here from what llama.cpp
itself reads: ``tokenizer.ggml.tokens`` / ``scores`` / ``token_type`` of a ``llama``-model
(SentencePiece) GGUF.  SentencePiece BPE merges the adjacent pair whose merged piece scores
highest, which is a BPE whose merges are ranked by the merged piece's score; pieces that are
not in the vocabulary fall back to their UTF-8 bytes (``<0xNN>``).  User-defined pieces (runs of
spaces, newlines and tabs, HTML tags) are matched whole before the BPE, as SentencePiece's
prefix matcher does, and control pieces (``<bos>``, ``<start_of_turn>``…) only where the text
spells them (the chat template does).

The result is a transformers ``PreTrainedTokenizerFast`` (for the optimum-intel export and for
tests), which :func:`write_openvino_tokenizers` converts with openvino-tokenizers into
``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml`` with the chat template in their
rt_info, where openvino-genai's ``Tokenizer`` reads it.

Needs ``tokenizers`` and ``transformers`` (the ``optimum`` extra) besides ``gguf``.

Whoever wrote a GGUF's tokenizer IRs (openvino-genai's converter or the code here), they are
only as sound as the metadata: merges that name pieces the vocabulary lacks convert without a
word and then fail on every text (``unordered_map::at`` in the BPE op).
:func:`converted_tokenizer_problem` tries the IRs on a few texts and on the chat template
before a conversion is cached; :func:`template_message` digs a failing chat template's own
message out of openvino-genai's error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import last_line

# SentencePiece piece types as llama.cpp writes them into tokenizer.ggml.token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# what a converted tokenizer must take: words, digits and signs, letters beyond ASCII
PROBES = ("Hello there", "1 + 2 = 3", "Grüße, 東京 — ok")
PROBE_CHAT = ({"role": "user", "content": PROBES[0]},)
# what the tokenizer's own failures come as (OpenVINO's are RuntimeError, pybind's TypeError)
TOKENIZER_ERRORS = (RuntimeError, TypeError, ValueError)
# a chat template's failure in openvino-genai's words: its message, then where in the template
_MINJA_ERROR = "Minja's error: "
_TEMPLATE_AT = re.compile(r"(?P<what>.*?)\s+at row (?P<row>\d+), column (?P<col>\d+):", re.S)


@dataclass(frozen=True)
class SpmVocab:
    """The tokenizer part of a SentencePiece GGUF's metadata."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SpmVocab:
        """Read it from ``gguf.GGUFReader(path).fields``; ``ValueError`` if it is not SPM."""

        def get(key: str, default: Any = None) -> Any:
            field = fields.get(f"tokenizer.{key}")
            return default if field is None else field.contents()

        model = get("ggml.model")
        if model != "llama":
            raise ValueError(
                f"tokenizer.ggml.model is {model!r}: only SentencePiece ('llama') GGUF "
                "tokenizers are rebuilt here"
            )
        tokens = [str(t) for t in get("ggml.tokens")]
        scores = [float(s) for s in get("ggml.scores")]
        types = [int(t) for t in get("ggml.token_type")]
        if not len(tokens) == len(scores) == len(types):
            raise ValueError(
                f"tokenizer.ggml.tokens/scores/token_type differ in length "
                f"({len(tokens)}/{len(scores)}/{len(types)})"
            )
        pad = get("ggml.padding_token_id")
        return cls(
            tokens=tokens,
            scores=scores,
            types=types,
            bos_id=int(get("ggml.bos_token_id")),
            eos_id=int(get("ggml.eos_token_id")),
            unk_id=int(get("ggml.unknown_token_id", 0)),
            pad_id=None if pad is None else int(pad),
            add_bos=bool(get("ggml.add_bos_token", True)),
            add_space_prefix=bool(get("ggml.add_space_prefix", True)),
            chat_template=get("chat_template"),
        )


def spm_merges(vocab: SpmVocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's BPE: every split of a normal piece into two
    normal pieces, ranked by the merged piece's score (highest first), ties by id."""
    index = {t: i for i, t in enumerate(vocab.tokens) if vocab.types[i] == NORMAL}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, merged in index.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append(
                    (-vocab.scores[merged], merged, index[left], index[right], left, right)
                )
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_hf_tokenizer(
    vocab: SpmVocab,
    chat_template: str | None = None,
    eos_token: str | None = None,
    model_max_length: int | None = None,
) -> Any:
    """A ``PreTrainedTokenizerFast`` that tokenizes as SentencePiece would with ``vocab``.

    ``chat_template`` (else the GGUF's) and ``eos_token`` (else the GGUF's eos piece; an
    instruction model's turn end, e.g. ``<end_of_turn>``, is what generation should stop on)
    go into the tokenizer and from there into the OpenVINO tokenizer's rt_info.
    """
    import tokenizers
    import transformers
    from tokenizers import decoders, normalizers, processors

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise ValueError("the GGUF vocabulary repeats a piece")
    model = tokenizers.models.BPE(
        vocab=ids,
        merges=spm_merges(vocab),
        unk_token=vocab.tokens[vocab.unk_id],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = tokenizers.Tokenizer(model)
    steps = [normalizers.Replace(" ", "▁")]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decode)
    # control pieces the text may spell (not the thousands of <unusedN> placeholders), then
    # user-defined pieces, matched whole on the raw text (normalized=False)
    control = [
        t
        for t, kind in zip(vocab.tokens, vocab.types, strict=True)
        if kind == CONTROL and not t.startswith("<unused")
    ]
    user = [t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == USER_DEFINED]
    tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False) for t in control])
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in user])
    bos = vocab.tokens[vocab.bos_id]
    if vocab.add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
    extra: dict[str, Any] = {}
    if model_max_length:
        extra["model_max_length"] = model_max_length
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos_token or vocab.tokens[vocab.eos_id],
        unk_token=vocab.tokens[vocab.unk_id],
        pad_token=None if vocab.pad_id is None else vocab.tokens[vocab.pad_id],
        chat_template=chat_template or vocab.chat_template,
        add_bos_token=vocab.add_bos,
        **extra,
    )


def write_openvino_tokenizers(hf_tokenizer: Any, out_dir: Path, vocab: SpmVocab) -> list[Path]:
    """Convert ``hf_tokenizer`` (built from ``vocab``) with openvino-tokenizers into
    ``out_dir``; return the files written."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    tokenizer, detokenizer = convert_tokenizer(
        hf_tokenizer, with_detokenizer=True, skip_special_tokens=True
    )
    raw_byte_pieces(detokenizer, vocab)
    written = []
    for model, name in ((tokenizer, "openvino_tokenizer"), (detokenizer, "openvino_detokenizer")):
        path = out_dir / f"{name}.xml"
        ov.save_model(model, str(path))
        written.append(path)
    return written


def raw_byte_pieces(detokenizer: Any, vocab: SpmVocab) -> None:
    """Make the detokenizer's ``<0xNN>`` pieces their raw bytes and drop its ByteFallback op.

    openvino-tokenizers' ByteFallback op (2026.4) takes every 6-byte piece written ``<…>``
    for a byte piece, so Gemma's ``<code>``, ``<html>``, ``<body>``, ``</div>``… decode as
    U+FFFD.  With the bytes in the vocabulary itself the op has nothing left to do.
    """
    import numpy as np
    import openvino as ov

    ops = {op.get_type_name(): op for op in detokenizer.get_ordered_ops()}
    decoder, fallback = ops.get("VocabDecoder"), ops.get("ByteFallback")
    if decoder is None or fallback is None:
        return
    entries: list[bytes] = []
    for piece, kind in zip(vocab.tokens, vocab.types, strict=True):
        if kind == BYTE and len(piece) == 6 and piece.startswith("<0x"):
            entries.append(bytes([int(piece[3:5], 16)]))
        else:
            entries.append(piece.encode())
    old = [decoder.input_value(i).get_node() for i in (1, 2, 3)]
    if any(op.get_type_name() != "Constant" for op in old) or old[0].get_output_shape(0) != [
        len(entries)
    ]:
        raise ValueError("unexpected detokenizer layout: its vocabulary is not three constants")
    ends = np.cumsum([len(e) for e in entries], dtype=np.int32)
    begins = np.concatenate([[0], ends[:-1]]).astype(np.int32)
    chars = np.frombuffer(b"".join(entries), np.uint8)
    for i, array in zip((1, 2, 3), (begins, ends, chars), strict=True):
        decoder.input(i).replace_source_output(ov.op.Constant(array).output(0))
    for k in range(fallback.get_output_size()):
        fallback.output(k).replace(fallback.input_value(k))
    detokenizer.validate_nodes_and_infer_types()


def pieces(vocab: SpmVocab, ids: Sequence[int]) -> list[str]:
    """The pieces of ``ids`` (for messages and tests)."""
    return [vocab.tokens[i] for i in ids]


def converted_tokenizer_problem(ir_dir: Path) -> str | None:
    """What makes the tokenizer IRs in ``ir_dir`` unusable, as a clause (None: they work).

    Costs a tenth of a second: the IRs are compiled and tried on :data:`PROBES` and, when
    there is a chat template, on a one-message chat (what every default prompt goes through).
    """
    import openvino_genai

    try:
        tokenizer = openvino_genai.Tokenizer(str(ir_dir))
    except TOKENIZER_ERRORS as exc:
        return f"its tokenizer IRs do not load ({last_line(exc)})"
    return tokenizer_problem(tokenizer)


def tokenizer_problem(tokenizer: Any) -> str | None:
    """What makes ``tokenizer`` (an ``openvino_genai.Tokenizer``) unusable, or None.

    An exact round trip is not asked for: a vocabulary without byte pieces may decode letters
    it lacks as ``<unk>``; only failures, no ids and no text are refused."""
    for text in PROBES:
        problem = _round_trip_problem(tokenizer, text)
        if problem is not None:
            return problem
    return _chat_problem(tokenizer) if tokenizer.chat_template else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids without BOS and the like (they would hide an empty encoding)."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return [int(i) for i in encoded.input_ids.data.reshape(-1)]


def _round_trip_problem(tokenizer: Any, text: str) -> str | None:
    try:
        ids = _encode(tokenizer, text)
    except TOKENIZER_ERRORS as exc:
        return f"encoding {text!r} fails ({last_line(exc)})"
    if not ids:
        return f"encoding {text!r} gives no token ids"
    try:
        decoded = tokenizer.decode(ids)
    except TOKENIZER_ERRORS as exc:
        return f"decoding the ids of {text!r} fails ({last_line(exc)})"
    if not decoded.strip():  # e.g. every piece typed a control piece, which decoding skips
        return f"the ids of {text!r} ({ids}) decode to no text"
    return None


def _chat_problem(tokenizer: Any) -> str | None:
    try:
        text = tokenizer.apply_chat_template(list(PROBE_CHAT), add_generation_prompt=True)
    except TOKENIZER_ERRORS as exc:
        return f"its chat template fails on a one-message chat: {template_message(exc)}"
    try:
        ids = _encode(tokenizer, text)
    except TOKENIZER_ERRORS as exc:
        return f"encoding the chat template's text {text!r} fails ({last_line(exc)})"
    return None if ids else f"the chat template's text {text!r} gives no token ids"


def template_message(exc: BaseException) -> str:
    """A failing chat template's own message, with where in the template it failed.

    openvino-genai's error ends with the template line and a caret under the failing spot
    (which is all :func:`~npuw_kv.errors.last_line` keeps); the message itself, e.g. the text
    of a template's ``raise_exception('...')`` or a syntax error, comes before it, after its
    advice on how to replace the template.
    """
    text = str(exc)
    if _MINJA_ERROR in text:
        text = text.split(_MINJA_ERROR, 1)[1]
    else:  # a parse failure comes bare, or after OpenVINO's "Exception from file:line:" lines
        lines = text.strip().splitlines()
        while len(lines) > 1 and lines[0].startswith("Exception from "):
            lines.pop(0)
        text = "\n".join(lines)
    match = _TEMPLATE_AT.match(text)
    if match is None:
        return last_line(exc)
    what = " ".join(match["what"].split()) or "no message"
    return f"{what} (at row {match['row']}, column {match['col']} of the template)"
