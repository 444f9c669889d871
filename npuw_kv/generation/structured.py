"""Structured output: openvino-genai's ``StructuredOutputConfig`` honoured as a logits mask.

:mod:`npuw_kv.generation.grammar` compiles the config's grammar with xgrammar (the library genai
itself uses); this module gives xgrammar the tokenizer's vocabulary (:func:`tokenizer_vocab`, one
compiler per tokenizer) and wraps its matcher as a :class:`GrammarConstraint`: ``apply`` masks
one row of logits, ``accept`` advances the matcher by the chosen token, ``done`` says when
nothing more may be generated.

How :func:`~npuw_kv.generation.decode.generate_tokens` drives it (its ``constraint`` argument): the
sampler chooses from ``apply(logits)``; a stop token ends generation without being accepted;
any other token is ``accept``-ed, and ``done()`` then ends generation with "stop" (so a regex
like ``[0-9]{3}`` stops after three digits even with ``ignore_eos``).  Build a fresh constraint
per sequence: ``constraint_for(config.structured_output_config, tokenizer, vocab_size,
config.stop_ids())``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import openvino_genai

from ..errors import UsageError
from .grammar import compile_grammar, grammar_source, xgrammar_message, xgrammar_module

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
        raise UsageError(
            "structured output needs the tokenizer's vocabulary, which this tokenizer does not "
            f"expose (no detokenizer IR with a VocabDecoder?): {xgrammar_message(exc)}"
        ) from exc
    if not mapping:
        raise UsageError("structured output needs the tokenizer's vocabulary, which is empty")
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
    init_us: float  # what building the three took (genai's grammar compiler init time)


# one backend per (tokenizer, model vocab size), dropped with the tokenizer
_BACKENDS: weakref.WeakKeyDictionary[Any, dict[int, _Backend]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
COMPILER_CACHE_BYTES = 64 << 20  # compiled grammars kept per tokenizer (xgrammar's own cache)


def _backend(tokenizer: openvino_genai.Tokenizer, vocab_size: int) -> _Backend:
    """xgrammar's ``TokenizerInfo`` and ``GrammarCompiler`` for ``tokenizer``, built once.

    Building them reads the whole vocabulary and decodes the special tokens, a cost worth
    paying once per tokenizer rather than per request; importing xgrammar (it imports torch and
    transformers) is paid on the first structured request only.  The compiler caches compiled
    grammars too (the figures: docs/measurements.md, "Figures behind the code's choices").
    """
    xgr = xgrammar_module()
    with _LOCK:
        per_size = _BACKENDS.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            started = time.perf_counter()
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
            init_us = 1e6 * (time.perf_counter() - started)
            per_size[vocab_size] = _Backend(vocab, info, compiler, init_us)
        return per_size[vocab_size]


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
        xgr = xgrammar_module()
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stops)
        self.compile_us = 0.0  # its grammar's compile time (constraint_for sets both)
        self.backend_init_us = 0.0  # its tokenizer's grammar backend's set-up time
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
            raise UsageError(
                f"expected one row of {self.vocab_size} logits, got shape {list(logits.shape)}"
            )
        allowed = self.allowed()
        if not allowed.any():
            raise UsageError(
                "structured output: no token can continue the grammar here"
                + (" (it is complete and has no stop token)" if self.done() else "")
            )
        out = logits.astype(np.result_type(logits.dtype, np.float32), copy=True)
        out[~allowed] = -np.inf
        return out

    def accept(self, token: int) -> None:
        token = int(token)
        if self._matcher.is_terminated():
            raise UsageError(
                f"structured output: token {token} after the grammar ended (a stop token was "
                "accepted); check done() before generating more"
            )
        if not (0 <= token < self.vocab_size and self.allowed()[token]):
            raise UsageError(
                f"structured output: token {token} ({self._text(token)}) is not allowed by the "
                f"grammar after {self._tail()}"
            )
        if not self._matcher.accept_token(token):  # the mask said yes: xgrammar disagrees
            raise UsageError(f"structured output: xgrammar refused token {token}")
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
        raise UsageError(f"eos_token_ids must be an id or ids, got {eos_token_ids!r}")
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
        raise UsageError(f"vocab_size must be positive, got {vocab_size}")
    backend = _backend(tokenizer, int(vocab_size))
    started = time.perf_counter()
    compiled = compile_grammar(backend.compiler, kind, text)
    stops = _stop_ids(eos_token_ids, tokenizer, int(vocab_size))
    constraint = GrammarConstraint(compiled, backend.vocab, int(vocab_size), stops)
    constraint.compile_us = 1e6 * (time.perf_counter() - started)
    constraint.backend_init_us = backend.init_us
    return constraint
