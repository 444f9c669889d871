"""The static shapes a pipeline's decisions ask for: chunk, prompt and KV lengths, the ladders
of variants and the rings (:class:`~npuw_kv.kv.shapes.StaticShapes`)."""

from __future__ import annotations

from ..config import decide
from ..config.decide import Decided
from ..config.pipeline_config import PipelineConfig
from ..kv.shapes import StaticShapes


def _shapes(
    config: PipelineConfig,
    kv_capacity: int,
    ladders: tuple[str, str],
    window_rings: bool,
    dense_blocks: bool,
) -> StaticShapes:
    prefill, generate = ladders
    return StaticShapes(
        config.prefill_chunk_size,
        config.max_prompt_len,
        kv_capacity,
        prefill != "one",
        generate != "one",
        lean_pyramid=prefill == "lean",
        lean_generate=generate == "lean",
        window_rings=window_rings,
        dense_blocks=dense_blocks,
    )


def static_shapes(decided: Decided[PipelineConfig], kv_capacity: int) -> StaticShapes:
    """The static shapes ``decided`` asks for: its ladders (``auto`` ones lean, an explicit
    ``pyramid`` / ``generate_pyramid=YES`` full) and rings.  Where V is not stored transposed,
    the KV buffer is cut into blocks where the static models' pasts end
    (``StaticShapes.block_edges``)."""
    ladders = (decided.prefill_ladder, decided.generate_ladder)
    return _shapes(decided.config, kv_capacity, ladders, decided.window_rings, decided.dense_blocks)


def shapes_for(config: PipelineConfig, kv_capacity: int) -> StaticShapes:
    """:func:`static_shapes` for a config alone, without a device to decide on (scripts and
    tests): the ladders and rings that :mod:`npuw_kv.config.decide` gives this config, one
    buffer (no dense blocks)."""
    ladders = (decide.prefill_ladder(config), decide.generate_ladder(config))
    return _shapes(config, kv_capacity, ladders, decide.window_rings(config), False)
