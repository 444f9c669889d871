"""The PagedAttention form of a stateful LLM IR, for the CPU plugin's paged-attention kernel.

On CPU the stateless graph loses the plugin's fused attention (it keeps it only for its own
stateful KV states), so attention runs decomposed: snippet kernels compiled per layer and
score buffers sized by the prefill chunk.  The plugin's ``PagedAttentionExtension`` op reads
and writes a KV cache that *we* allocate and index (one tensor per layer for K and for V,
addressed through a block table), quantises it to u8 by default, and attends without those
buffers.  One compiled model serves prefill chunks and generate steps over the same cache.
"""

from __future__ import annotations

import re

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from ..errors import ModelLayoutError
from .head import head_matmul
from .transforms import lm_head_on_last

CACHE_PREFIXES = ("key_cache.", "value_cache.")
# which of the call's tokens get logits (row indices into the call's tokens, axis 0): the last
# token of each sequence in the call; every candidate of speculative decoding's verify
LOGITS_ROWS = "logits_rows"
# inputs of PagedAttentionExtension (OpenVINO's order)
_BLOCK_INDICES, _SLIDING_WINDOW = 7, 10


def cache_inputs(model: ov.Model | ov.CompiledModel) -> list[ov.Output]:
    """The KV cache inputs of a paged model, K and V of every layer."""
    return [i for i in model.inputs if i.get_any_name().startswith(CACHE_PREFIXES)]


# the rewrite's linear-attention state tables (``conv_state_table.0``, ...), and the inputs
# that address them: a group per prefix (``la.``), each ``{prefix}`` + these four
_STATE_TABLE = re.compile(r".+_state_table\.\d+$")
STATE_PAGING = ("block_indices", "block_indices_begins", "past_lens", "cache_interval")


def state_inputs(model: ov.Model | ov.CompiledModel) -> list[ov.Output]:
    """The state tables of a paged hybrid model's linear-attention layers (none: no such
    layer)."""
    return [i for i in model.inputs if _STATE_TABLE.match(i.get_any_name())]


def state_paging_prefixes(model: ov.Model | ov.CompiledModel) -> list[str]:
    """The prefixes of the inputs that address the state tables (``la.``)."""
    marker = STATE_PAGING[1]
    names = [i.get_any_name() for i in model.inputs]
    return [n.removesuffix(marker) for n in names if n.endswith(marker) and n != marker]


def state_ops(model: ov.Model) -> dict[str, list[str]]:
    """The ops reading each state table (``{"conv_state_table.0": ["PagedCausalConv1D"]}``)."""
    return {
        i.get_any_name(): sorted({t.get_node().get_type_name() for t in i.get_target_inputs()})
        for i in state_inputs(model)
    }


def make_paged(model: ov.Model, full_logits: bool = False, tree_mask: bool = False) -> ov.Model:
    """Rewrite ``model`` (stateful, in place) to PagedAttention with last-token logits.

    ``full_logits`` keeps the LM head on every token (perplexity only, as in ``prepare``);
    ``tree_mask`` adds the query-to-query mask inputs that check a tree of candidates in one
    call (``runtime/paged/tree_mask.py``; speculative decoding's tree search).
    """
    try:
        paged_attention_transformation(model, False, False, allow_qq_bias=tree_mask)
    except RuntimeError as exc:
        raise ModelLayoutError(f"cannot rewrite the model to PagedAttention: {exc}") from exc
    if not cache_inputs(model):
        raise ModelLayoutError("no attention with a KV cache found: not a decoder LLM")
    if not full_logits:
        _logits_for_last_token(model)
    return model


def block_table_input(window: int | None) -> str:
    """The block-table input of the layers with this attention window (None: full)."""
    return "block_indices" if window is None else f"block_indices.{window}"


def layer_windows(model: ov.Model) -> tuple[int | None, ...]:
    """The attention window of every layer of a paged model (None: full attention).

    OpenVINO's rewrite gives each ``PagedAttentionExtension`` its layer's window as input 10
    (0: none), a constant expression; the layer is the one whose ``key_cache.{i}`` it reads.
    """
    windows: list[int | None] = []
    for layer, node in _attention_by_layer(model):
        window = _constant_value(node.input(_SLIDING_WINDOW).get_source_output())
        if window is None:
            raise ModelLayoutError(
                f"cannot read the sliding window of layer {layer}: not a constant expression"
            )
        windows.append(window or None)
    return tuple(windows)


def _attention_by_layer(model: ov.Model) -> list[tuple[int, ov.Node]]:
    """Each ``PagedAttentionExtension`` with its layer (the ``key_cache.{i}`` it reads), in
    layer order; the layers must be 0..N-1."""
    found = {}
    for node in model.get_ordered_ops():
        if node.get_type_name() != "PagedAttentionExtension":
            continue
        cache = node.input(3).get_source_output().get_node().get_friendly_name()
        if not cache.startswith(CACHE_PREFIXES[0]):
            raise ModelLayoutError(f"paged attention reads {cache!r}, not a key cache")
        found[int(cache.removeprefix(CACHE_PREFIXES[0]))] = node
    if sorted(found) != list(range(len(found))):
        raise ModelLayoutError(f"paged attention layers {sorted(found)} are not 0..N-1")
    return sorted(found.items())


def positions_from_cache_length(model: ov.Model) -> int:
    """How many attention ops of a paged model take their keys' positions from the cache
    length instead of ``position_ids``.

    An export that numbers its tokens from the past length in the graph (rather than taking
    ``position_ids``) becomes, after OpenVINO's rewrite, rotary positions of
    ``max_context_len - 1`` for every token of a call: right for one token, wrong for every
    token but the last of a prefill chunk (optimum-intel 2.2's text-only Qwen3.5, LFM2 under
    transformers 5.5, Granite 4.0-H).  Found by which of the two inputs reaches each op's key
    from its own layer (the walk stops at the earlier layers' attention ops).
    """
    wanted = {"position_ids", "max_context_len"}
    reach: dict[str, frozenset[str]] = {}
    wrong = 0
    for node in model.get_ordered_ops():
        kind = node.get_type_name()
        if kind == "Parameter":
            names = node.output(0).get_names() | {node.get_friendly_name()}
            reach[node.get_name()] = frozenset(names & wanted)
            continue
        seen = frozenset().union(
            *(reach[i.get_source_output().get_node().get_name()] for i in node.inputs())
        )
        if kind == "PagedAttentionExtension":
            key = reach[node.input(1).get_source_output().get_node().get_name()]
            wrong += "max_context_len" in key and "position_ids" not in key
            seen = frozenset()
        reach[node.get_name()] = seen
    return wrong


def split_block_tables(model: ov.Model, capacity: int) -> tuple[int | None, ...]:
    """Give the layers of each sliding window a block table of their own; return the windows.

    The rewrite feeds one ``block_indices`` to every layer, so a windowed layer would keep the
    blocks its window has left.  With a table per window (``block_table_input``) the block
    manager can detach those blocks from the windowed layers alone.  A window of at least
    ``capacity`` tokens cannot leave any and counts as full attention (None).  The full
    table is removed when no layer reads it.
    """
    windows = tuple(None if w is None or w >= capacity else w for w in layer_windows(model))
    shared = next(p for p in model.get_parameters() if p.get_friendly_name() == "block_indices")
    tables: dict[int, ov.Node] = {}
    for layer, node in _attention_by_layer(model):
        window = windows[layer]
        if window is None:
            continue
        if window not in tables:
            name = block_table_input(window)
            tables[window] = ops.parameter([-1], ov.Type.i32, name=name)
            tables[window].output(0).set_names({name})
        node.input(_BLOCK_INDICES).replace_source_output(tables[window].output(0))
    model.add_parameters(list(tables.values()))
    if not shared.output(0).get_target_inputs():
        model.remove_parameter(shared)
    model.validate_nodes_and_infer_types()
    return windows


def _constant_value(output: ov.Output) -> int | None:
    """The value of a scalar integer expression of constants (Convert, Squeeze, Multiply...)."""
    node = output.get_node()
    kind = node.get_type_name()
    if kind == "Constant":
        return int(np.asarray(node.get_data()).ravel()[0])
    args = [_constant_value(i.get_source_output()) for i in node.inputs()]
    if kind in ("Convert", "Squeeze", "Unsqueeze", "Reshape") and args[0] is not None:
        return args[0]
    if kind in ("Multiply", "Add", "Subtract") and None not in args[:2]:
        a, b = args[0], args[1]
        assert a is not None and b is not None
        return a * b if kind == "Multiply" else a + b if kind == "Add" else a - b
    if kind == "Negative" and args[0] is not None:
        return -args[0]
    return None


def _logits_for_last_token(model: ov.Model) -> None:
    """The LM head on the chosen tokens only: in a paged model tokens run along axis 0.

    Which is the ``LOGITS_ROWS`` input ([n], i64, row indices into the call's tokens): the
    last token of each sequence a call runs (one for a lone prefill chunk or generate step, one
    per sequence in a batched step); a speculative verify call asks for every row, to check
    each candidate token.
    """
    logits = [o for o in model.outputs if "logits" in o.get_names()]
    if not logits:
        raise ModelLayoutError("the model has no 'logits' output")
    lm_head_on_last(model, logits[0].get_node(), axis=0)
    rows = ops.parameter([-1], ov.Type.i64, name=LOGITS_ROWS)
    rows.output(0).set_names({LOGITS_ROWS})
    head = head_matmul(logits[0].get_node())
    last = head.input(0).get_source_output().get_node()  # lm_head_on_last's Slice
    hidden = last.input(0).get_source_output()
    chosen = ops.gather(hidden, rows, ops.constant(np.array(0, np.int64)))
    head.input(0).replace_source_output(chosen.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()
