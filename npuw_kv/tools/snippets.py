"""What one more decomposed attention op costs the CPU plugin at compile time.

The static-shape path's stateless graph gets SDPA decomposed, and snippets compile a kernel per
op; ``python -m npuw_kv.tools.bench --snippet-kernels`` prints that per-op memory (the figures are
in docs/measurements.md, "What did not help"), each configuration in its own process so that the
plugin starts cold.
"""

from __future__ import annotations

import sys

from . import children
from .bench_worker import sigterm_exits, status_mb

# (heads, head_dim) of the attention ops ``--snippet-kernels`` compiles: SmolLM2's 9 x 64 and
# its neighbours
SNIPPET_SHAPES = ((3, 64), (9, 64), (32, 64), (9, 128))


def _anon_mb() -> float:
    anon = status_mb("RssAnon")
    if anon is None:
        raise RuntimeError("the snippet probe reads RssAnon from /proc/self/status (Linux)")
    return anon


def snippet_probe(ops_count: int, heads: int, head_dim: int) -> float:
    """MB of anonymous memory ``compile_model`` takes for ``ops_count`` independent
    dynamic-shape SDPA ops (f32, so snippets compile each one as an MHA subgraph)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    qkv = [ops.parameter([1, heads, -1, head_dim], np.float32, name=x) for x in ("q", "k", "v")]
    mask = ops.parameter([1, 1, -1, -1], np.float32, name="m")
    outs = [ops.result(ops.scaled_dot_product_attention(*qkv, mask)) for _ in range(ops_count)]
    model = ov.Model(outs, [*qkv, mask])
    core = ov.Core()
    before = _anon_mb()
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    grown = _anon_mb() - before
    del compiled  # measured while alive
    return grown


def snippet_kernels(shapes: tuple[tuple[int, int], ...] = SNIPPET_SHAPES) -> None:
    """Print the compile-time MB of 1 and 10 attention ops per shape, and per extra op."""

    def compile_mb(ops_count: int, heads: int, head_dim: int) -> float:
        cmd = [sys.executable, "-m", "npuw_kv.tools.bench", "--snippet-probe"]
        cmd += [str(ops_count), str(heads), str(head_dim)]
        with sigterm_exits():  # the probe is killed on the way out, not orphaned
            return float(children.run_output(cmd))

    print("heads  head_dim  MB for 1 op  MB for 10 ops  MB per extra op", flush=True)
    for heads, head_dim in shapes:
        one, ten = compile_mb(1, heads, head_dim), compile_mb(10, heads, head_dim)
        print(
            f"{heads:>5}  {head_dim:>8}  {one:>11.1f}  {ten:>13.1f}  {(ten - one) / 9:>15.2f}",
            flush=True,
        )
