"""Every error a user of npuw-kv may catch, in one place (no OpenVINO needed to import it).

Each is a ``ValueError`` (or, for a missing model, a ``FileNotFoundError``) so that callers
who only know the standard types still catch them, and also a ``RuntimeError``, which is what
openvino-genai raises for the same mistakes, so that code written for genai catches them too.
The message names the setting to change.  After any of them the pipeline stays usable.
"""

from __future__ import annotations


class UsageError(ValueError, RuntimeError):
    """A setting, an input or a generation config that cannot be honoured (genai raises a
    ``RuntimeError`` where npuw-kv documents a ``ValueError``: this is both)."""


class ModelSourceError(FileNotFoundError, RuntimeError):
    """A model argument that does not lead to usable model files (missing, corrupt GGUF)."""


class ModelLoadError(UsageError):
    """Model files exist but cannot be read as an OpenVINO IR (or their tokenizer IRs)."""


class ModelLayoutError(UsageError):
    """The graph is not a decoder LLM with a KV cache we can drive."""


class CompileError(UsageError):
    """The device refused the model with these settings (names them)."""


class NumericError(UsageError):
    """The model gave NaN or +inf logits: an activation overflowed its precision."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            # the pipeline names the settings that would widen it (Engine.numeric_error); a
            # remedy here could name one already set
            or "the model gave NaN or +inf logits: an activation overflowed its precision"
        )

    @classmethod
    def with_remedies(cls, remedies: list[str]) -> NumericError:
        """The error naming the settings that would keep every value in a wider precision;
        none left (all f32 already): no setting removes it, and it says so."""
        if not remedies:
            return cls(
                "the model gave NaN or +inf logits with f32 compute, f32 KV and f32 between "
                "sub-graphs: no precision setting removes it (look at the model's weights or "
                "its conversion)"
            )
        return cls(
            "the model gave NaN or +inf logits: an activation overflowed its precision; "
            + "; or ".join(remedies)
        )


class CapacityError(UsageError):
    """A prompt longer than MAX_PROMPT_LEN, or a step with the KV cache full."""

    @classmethod
    def prompt(cls, tokens: int, max_prompt_len: int) -> CapacityError:
        return cls(
            f"prompt has {tokens} tokens but MAX_PROMPT_LEN is {max_prompt_len}; "
            "raise max_prompt_len (MAX_PROMPT_LEN / NPUW_LLM_MAX_PROMPT_LEN) "
            f"to at least {tokens}"
        )

    @classmethod
    def cache_full(cls, slots: int) -> CapacityError:
        return cls(f"KV cache is full ({slots} slots); raise min_response_len (MIN_RESPONSE_LEN)")


def last_line(exc: BaseException) -> str:
    """The last line of an error message (OpenVINO's carry their C++ call stack before it)."""
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__
