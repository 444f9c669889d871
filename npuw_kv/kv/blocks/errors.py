"""Errors raised by the block manager.

Every error is a ``ValueError`` or ``KeyError`` subclass whose message names the setting or the
call to change. An error is raised before any state changes, so after catching it the manager is
exactly as it was (``check_invariants()`` still passes).
"""

from __future__ import annotations


class BlockManagerError(Exception):
    """Base class so callers can catch every block-manager error at once."""


class ConfigError(BlockManagerError, ValueError):
    """A setting is invalid (layer layout, block size, priorities, dtype)."""


class SharesError(ConfigError):
    """The window-size shares (setting or ``NPUW_KV_WINDOW_SIZE_SHARES``) are malformed."""


class WindowTooLargeError(ConfigError):
    """A layer's attention window exceeds ``max_seq_len``."""


class BudgetTooSmallError(ConfigError):
    """The memory budget cannot hold the blocks of even one maximum-length sequence."""


class SequenceTooLongError(BlockManagerError, ValueError):
    """A sequence would grow past ``max_seq_len``."""


class SequenceExistsError(BlockManagerError, ValueError):
    """``add_sequence`` was called with an id that is still live."""


class ChunkTooLargeError(BlockManagerError, ValueError):
    """One call would add more tokens than ``max_tokens_per_call`` (the budget check's chunk)."""


class OutOfBlocksError(BlockManagerError, ValueError):
    """Not enough reclaimable primary blocks right now (live sequences hold them)."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """The sequence id is not live (never added, or already removed)."""

    def __str__(self) -> str:  # KeyError would print the message inside quotes
        return str(self.args[0]) if self.args else ""


class InvalidTokensError(BlockManagerError, ValueError):
    """Token ids must be integers."""
