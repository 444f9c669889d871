"""Structured output: openvino-genai's ``StructuredOutputConfig`` honoured as a logits mask.

The grammar engine is xgrammar, the library openvino-genai itself uses for this (it is built
into openvino-genai's C++ library, not exposed to Python, so we use the PyPI package; install
it with ``pip install 'npuw-kv[structured]'``).  This module turns every form genai accepts
(a JSON schema, a regex, an EBNF grammar, structural tags and the compound grammar classes
``StructuredOutputConfig.Regex`` / ``.JSONSchema`` / ``.EBNF`` / ``.ConstString`` /
``.AnyText`` / ``.QwenXMLParametersFormat`` / ``.Concat`` / ``.Union`` / ``.Tag`` /
``.TriggeredTags`` / ``.TagsWithSeparator``, and the older ``StructuralTagsConfig``) into an
xgrammar grammar exactly as genai's ``xgrammar_backend.cpp`` does, and wraps xgrammar's matcher
as a :class:`GrammarConstraint`: ``apply`` masks one row of logits, ``accept`` advances the
matcher by the chosen token, ``done`` says when nothing more may be generated.

How :func:`~npuw_kv.decode.generate_tokens` drives it (its ``constraint`` argument): the
sampler chooses from ``apply(logits)``; a stop token ends generation without being accepted;
any other token is ``accept``-ed, and ``done()`` then ends generation with "stop" (so a regex
like ``[0-9]{3}`` stops after three digits even with ``ignore_eos``).  Build a fresh constraint
per sequence: ``constraint_for(config.structured_output_config, tokenizer, vocab_size,
config.stop_ids())``.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import openvino_genai

INSTALL_HINT = "pip install 'npuw-kv[structured]' (or: pip install xgrammar)"

# StructuredOutputConfig's grammar fields; genai allows exactly one of them to be set
GRAMMAR_FIELDS = ("json_schema", "regex", "grammar", "structural_tags_config", "compound_grammar")

# xgrammar's C++ errors start with "[12:34:56] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (...) is false: "; the rest is the message meant for the user
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _xgrammar() -> Any:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise ModuleNotFoundError(
            "structured output (GenerationConfig.structured_output_config) needs the xgrammar "
            f"package, which could not be imported ({exc}): {INSTALL_HINT}"
        ) from exc
    return xgr


def _xgr_message(exc: BaseException) -> str:
    lines = [_XGR_PREFIX.sub("", line) for line in str(exc).strip().splitlines()]
    return " ".join(line.strip() for line in lines if line.strip()) or type(exc).__name__


# -- the tokenizer's vocabulary as xgrammar wants it -----------------------------------------

SENTENCEPIECE_SPACE = "\u2581".encode()  # "▁"
BYTE_LEVEL_SPACE = "\u0120".encode()  # "Ġ"


def vocab_type_of(vocab: list[bytes]) -> str:
    """How the detokenizer's vocabulary spells its tokens, as an xgrammar ``VocabType`` name.

    openvino-tokenizers stores byte-level BPE vocabularies (GPT-2, SmolLM2, Llama 3, Qwen) as
    the raw bytes each token stands for ("RAW"); SentencePiece BPE ones keep "▁" for a space
    and "<0x0A>" byte pieces, which a later detokenizer op undoes ("BYTE_FALLBACK"); a
    vocabulary still in the GPT-2 byte-to-unicode spelling ("Ġ" for a space) is "BYTE_LEVEL".
    """
    ordinary = [t for t in vocab if t]
    if not ordinary:
        return "RAW"
    if b"<0x0A>" in vocab and sum(SENTENCEPIECE_SPACE in t for t in ordinary) > 0.05 * len(
        ordinary
    ):
        return "BYTE_FALLBACK"
    has_space = sum(b" " in t for t in ordinary)
    if has_space == 0 and sum(BYTE_LEVEL_SPACE in t for t in ordinary) > 0.05 * len(ordinary):
        return "BYTE_LEVEL"
    return "RAW"


def tokenizer_vocab(tokenizer: openvino_genai.Tokenizer) -> list[bytes]:
    """Each token id's bytes, from the detokenizer IR (``Tokenizer.get_vocab``).

    ``get_vocab_vector`` would be the natural call but decodes every token as UTF-8 and fails
    on byte-level BPE's partial-character tokens (b"\\xa1"); ``get_vocab`` gives bytes.  Ids
    it does not name, and special tokens (``<|im_start|>``: the detokenizer drops them when
    skipping special tokens, so they are not text), get b"", which xgrammar treats as a
    special token the grammar never allows (stop tokens are handled apart, by id).
    """
    try:
        mapping = tokenizer.get_vocab()
    except RuntimeError as exc:
        raise ValueError(
            "structured output needs the tokenizer's vocabulary, which this tokenizer does not "
            f"expose (no detokenizer IR with a VocabDecoder?): {_xgr_message(exc)}"
        ) from exc
    if not mapping:
        raise ValueError("structured output needs the tokenizer's vocabulary, which is empty")
    vocab = [b""] * (max(mapping.values()) + 1)
    for piece, index in mapping.items():
        vocab[index] = piece if isinstance(piece, bytes) else str(piece).encode()
    ids = [[i] for i in range(len(vocab))]
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    full = tokenizer.decode(ids, skip_special_tokens=False)
    for index, (text, raw) in enumerate(zip(kept, full, strict=True)):
        if raw and not text:
            vocab[index] = b""
    return vocab


@dataclass
class _Backend:
    vocab: list[bytes]
    info: Any  # xgrammar.TokenizerInfo
    compiler: Any  # xgrammar.GrammarCompiler


# one backend per (tokenizer, model vocab size), dropped with the tokenizer
_BACKENDS: weakref.WeakKeyDictionary[Any, dict[int, _Backend]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
COMPILER_CACHE_BYTES = 64 << 20  # compiled grammars kept per tokenizer (xgrammar's own cache)


def _backend(tokenizer: openvino_genai.Tokenizer, vocab_size: int) -> _Backend:
    """xgrammar's ``TokenizerInfo`` and ``GrammarCompiler`` for ``tokenizer``, built once.

    Measured for SmolLM2's 49,152 tokens on this project's 2-core machine: building them takes
    0.12-0.2 s (``get_vocab`` 0.03-0.04 s, the two batch decodes that find the special tokens
    0.06-0.1 s, the ``TokenizerInfo`` 0.02 s), 0.4-0.6 s when the tokenizer has never decoded
    before; a cached lookup takes ~20 us.  Importing xgrammar once per process costs 2-4 s more
    (it imports torch and transformers), paid on the first structured request only.  The
    compiler caches compiled grammars too: a small JSON schema compiles in ~5-7 ms, a short
    regex in ~0.5 ms, the same one again in ~0.1 ms; one mask costs ~0.05 ms.
    """
    xgr = _xgrammar()
    with _LOCK:
        per_size = _BACKENDS.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            vocab = tokenizer_vocab(tokenizer)[:vocab_size]  # rows the model cannot produce
            kind = vocab_type_of(vocab)
            info = xgr.TokenizerInfo(
                vocab,
                getattr(xgr.VocabType, kind),
                vocab_size=vocab_size,  # > len(vocab): padding rows, never allowed
                stop_token_ids=None,  # set per matcher from the generation config
                add_prefix_space=kind == "BYTE_FALLBACK",
            )
            compiler = xgr.GrammarCompiler(
                info,
                max_threads=max(1, min(8, os.cpu_count() or 1)),
                cache_limit_bytes=COMPILER_CACHE_BYTES,
            )
            per_size[vocab_size] = _Backend(vocab, info, compiler)
        return per_size[vocab_size]


# -- genai's grammar forms as xgrammar grammars ------------------------------------------------


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"structured output: {what} is not valid JSON: {exc}") from None


def structural_tag_format(tag: Any) -> dict[str, Any]:
    """One genai structural tag (or compound grammar element) as xgrammar's JSON format,
    field for field as genai's ``to_json`` writes it (a string is taken as that JSON)."""
    soc = openvino_genai.StructuredOutputConfig
    if isinstance(tag, str):
        value = _json(tag, "a structural tag given as a string")
        if not isinstance(value, dict):
            raise ValueError(f"structured output: a structural tag must be a JSON object: {tag!r}")
        return value
    if isinstance(tag, soc.Regex):
        return {"type": "regex", "pattern": tag.value}
    if isinstance(tag, soc.JSONSchema):
        return {"type": "json_schema", "json_schema": _json(tag.value, "JSONSchema")}
    if isinstance(tag, soc.EBNF):
        return {"type": "grammar", "grammar": tag.value}
    if isinstance(tag, soc.ConstString):
        return {"type": "const_string", "value": tag.value}
    if isinstance(tag, soc.AnyText):
        return {"type": "any_text"}
    if isinstance(tag, soc.QwenXMLParametersFormat):
        schema = _json(tag.json_schema, "QwenXMLParametersFormat's json_schema")
        return {"type": "qwen_xml_parameter", "json_schema": schema}
    if isinstance(tag, soc.Concat):
        return {"type": "sequence", "elements": [structural_tag_format(e) for e in tag.elements]}
    if isinstance(tag, soc.Union):
        return {"type": "or", "elements": [structural_tag_format(e) for e in tag.elements]}
    if isinstance(tag, soc.Tag):
        content = structural_tag_format(tag.content)
        return {"type": "tag", "begin": tag.begin, "content": content, "end": tag.end}
    if isinstance(tag, soc.TriggeredTags):
        return {
            "type": "triggered_tags",
            "triggers": list(tag.triggers),
            "tags": [structural_tag_format(t) for t in tag.tags],
            "at_least_one": bool(tag.at_least_one),
            "stop_after_first": bool(tag.stop_after_first),
        }
    if isinstance(tag, soc.TagsWithSeparator):
        return {
            "type": "tags_with_separator",
            "separator": tag.separator,
            "tags": [structural_tag_format(t) for t in tag.tags],
            "at_least_one": bool(tag.at_least_one),
            "stop_after_first": bool(tag.stop_after_first),
        }
    if isinstance(tag, openvino_genai.StructuralTagsConfig):  # the deprecated form
        tags = [
            {
                "type": "tag",
                "begin": item.begin,
                "content": {"type": "json_schema", "json_schema": _json(item.schema, "a schema")},
                "end": item.end,
            }
            for item in tag.structural_tags
        ]
        return {
            "type": "triggered_tags",
            "triggers": list(tag.triggers),
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": False,
        }
    raise ValueError(f"structured output: unsupported structural tag {tag!r}")


def structural_tag_json(value: Any) -> str:
    """The structural tag JSON xgrammar compiles, for ``structural_tags_config`` /
    ``compound_grammar``; a string there is already the whole structural tag (as in genai)."""
    if isinstance(value, str):
        return value
    return json.dumps({"type": "structural_tag", "format": structural_tag_format(value)})


def grammar_source(config: Any) -> tuple[str, str]:
    """``(kind, text)`` of the one grammar ``config`` sets: kind is "json_schema", "regex",
    "ebnf" or "structural_tag"."""
    given = {name: getattr(config, name, None) for name in GRAMMAR_FIELDS}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) != 1:
        raise ValueError(
            "structured_output_config must set exactly one of "
            f"{', '.join(GRAMMAR_FIELDS)}; got {sorted(given) or 'none'}"
        )
    ((name, value),) = given.items()
    if name in ("json_schema", "regex", "grammar"):
        if not isinstance(value, str):
            raise ValueError(f"structured_output_config.{name} must be a string, got {value!r}")
        return ("ebnf" if name == "grammar" else name), value
    return "structural_tag", structural_tag_json(value)


def compile_grammar(compiler: Any, kind: str, text: str) -> Any:
    """``text`` compiled by xgrammar; what xgrammar rejects is a ``ValueError`` with its
    message.  JSON schemas compile with xgrammar's defaults, as in genai (any whitespace,
    strict: no properties beyond the schema's)."""
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(text)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        return compiler.compile_structural_tag(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        label = {"json_schema": "JSON schema", "ebnf": "EBNF grammar"}.get(kind, kind)
        raise ValueError(
            f"structured output: xgrammar rejected the {label.replace('_', ' ')}: "
            f"{_xgr_message(exc)}"
        ) from None


# -- the constraint ------------------------------------------------------------------------------


class GrammarConstraint:
    """The tokens a grammar allows next, as a logits mask (a ``LogitsConstraint``).

    ``apply(logits)`` returns a copy of one row of logits (the model's vocabulary size, which
    may exceed the tokenizer's: padding rows are never allowed) with every token the grammar
    does not allow next at -inf.  ``accept(token)`` advances the matcher (``ValueError`` for a
    token the grammar does not allow).  ``done()``: nothing more may be generated, because the
    grammar is complete and allows nothing but a stop token, or a stop token was accepted;
    after that ``apply`` allows the stop tokens only.
    """

    def __init__(self, compiled: Any, vocab: list[bytes], vocab_size: int, stops: list[int]):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stops)
        self._vocab = vocab
        self._matcher = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=self.stop_token_ids or None,
            terminate_without_stop_token=not self.stop_token_ids,
        )
        self._bitmask = np.full(xgr.get_bitmask_shape(1, vocab_size), -1, np.int32)
        self._stops = np.zeros(vocab_size, bool)
        self._stops[self.stop_token_ids] = True
        self._allowed: np.ndarray | None = None  # of the current state
        self.tokens: list[int] = []  # accepted so far

    def allowed(self) -> np.ndarray:
        """Boolean mask over the model's vocabulary: the tokens allowed next."""
        if self._allowed is None:
            if self._matcher.is_terminated():
                self._allowed = self._stops.copy()
            else:
                self._matcher.fill_next_token_bitmask(self._bitmask)
                bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
                self._allowed = bits[: self.vocab_size].astype(bool)
        return self._allowed

    def apply(self, logits: np.ndarray) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.shape != (self.vocab_size,):
            raise ValueError(
                f"expected one row of {self.vocab_size} logits, got shape {list(logits.shape)}"
            )
        allowed = self.allowed()
        if not allowed.any():
            raise ValueError(
                "structured output: no token can continue the grammar here"
                + (" (it is complete and has no stop token)" if self.done() else "")
            )
        out = logits.astype(np.result_type(logits.dtype, np.float32), copy=True)
        out[~allowed] = -np.inf
        return out

    def accept(self, token: int) -> None:
        token = int(token)
        if self._matcher.is_terminated():
            raise ValueError(
                f"structured output: token {token} after the grammar ended (a stop token was "
                "accepted); check done() before generating more"
            )
        if not (0 <= token < self.vocab_size and self.allowed()[token]):
            raise ValueError(
                f"structured output: token {token} ({self._text(token)}) is not allowed by the "
                f"grammar after {self._tail()}"
            )
        if not self._matcher.accept_token(token):  # the mask said yes: xgrammar disagrees
            raise ValueError(f"structured output: xgrammar refused token {token}")
        self.tokens.append(token)
        self._allowed = None

    def done(self) -> bool:
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        return not bool((self.allowed() & ~self._stops).any())

    def _text(self, token: int) -> str:
        if not 0 <= token < len(self._vocab):
            return "outside the tokenizer's vocabulary"
        piece = self._vocab[token]
        return repr(piece.decode("utf-8", "replace")) if piece else "a special token"

    def _tail(self, chars: int = 40) -> str:
        if not self.tokens:
            return "no output yet"
        text = b"".join(self._vocab[t] for t in self.tokens if t < len(self._vocab))
        tail = text.decode("utf-8", "replace")
        return f"{tail[-chars:]!r}" if len(tail) <= chars else f"...{tail[-chars:]!r}"


def _stop_ids(eos_token_ids: Any, tokenizer: openvino_genai.Tokenizer, size: int) -> list[int]:
    if eos_token_ids is None:
        ids: list[int] = []
    elif isinstance(eos_token_ids, (int, np.integer)):
        ids = [int(eos_token_ids)]
    elif isinstance(eos_token_ids, Iterable):
        ids = [int(i) for i in eos_token_ids]
    else:
        raise ValueError(f"eos_token_ids must be an id or ids, got {eos_token_ids!r}")
    ids = [i for i in ids if 0 <= i < size]  # genai's unset eos is -1
    if not ids:
        eos = int(tokenizer.get_eos_token_id())
        ids = [eos] if 0 <= eos < size else []
    return sorted(set(ids))


def constraint_for(
    structured_output_config: Any,
    tokenizer: openvino_genai.Tokenizer,
    vocab_size: int,
    eos_token_ids: int | Iterable[int] | None = None,
) -> GrammarConstraint | None:
    """A fresh :class:`GrammarConstraint` for one generation, or None without a config.

    ``structured_output_config``: an ``openvino_genai.StructuredOutputConfig`` (or anything
    with its fields).  ``vocab_size``: the model's logits width.  ``eos_token_ids``: the stop
    tokens the grammar ends with (an id or ids; None or only invalid ids: the tokenizer's EOS).
    Raises ``ValueError`` for a grammar xgrammar rejects (with its message), and
    ``ModuleNotFoundError`` naming the install command when xgrammar is missing.
    """
    if structured_output_config is None:
        return None
    kind, text = grammar_source(structured_output_config)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    backend = _backend(tokenizer, int(vocab_size))
    compiled = compile_grammar(backend.compiler, kind, text)
    stops = _stop_ids(eos_token_ids, tokenizer, int(vocab_size))
    return GrammarConstraint(compiled, backend.vocab, int(vocab_size), stops)
