"""Anonymous memory the CPU plugin allocates at compile time per decomposed attention op.

Builds models of N independent, dynamic-shape SDPA ops (f32, so snippets compile each one as
an MHA subgraph) and prints the RssAnon growth of compile_model, for several head counts and
head sizes: the per-op cost is what one more attention layer costs at load (README, "Speed
and memory").  Each configuration runs in its own process.

    python scripts/snippet_kernel_memory.py
"""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys, numpy as np, openvino as ov, openvino.opset13 as ops
def anon():
    line = next(x for x in open("/proc/self/status") if x.startswith("RssAnon"))
    return int(line.split()[1]) / 1024
n, h, d = (int(x) for x in sys.argv[1:4])
names = ("q", "k", "v")
qkv = [ops.parameter([1, h, -1, d], np.float32, name=x) for x in names]
mask = ops.parameter([1, 1, -1, -1], np.float32, name="m")
outs = [ops.result(ops.scaled_dot_product_attention(*qkv, mask)) for _ in range(n)]
model = ov.Model(outs, [*qkv, mask])
core = ov.Core()
before = anon()
compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})  # kept alive
print(f"{anon() - before:.1f}")
"""


def compile_mb(ops_count: int, heads: int, head_dim: int) -> float:
    run = [sys.executable, "-c", _PROBE, str(ops_count), str(heads), str(head_dim)]
    return float(subprocess.run(run, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    print("heads  head_dim  MB for 1 op  MB for 10 ops  MB per extra op")
    for heads, head_dim in ((3, 64), (9, 64), (32, 64), (9, 128)):
        one, ten = compile_mb(1, heads, head_dim), compile_mb(10, heads, head_dim)
        print(f"{heads:>5}  {head_dim:>8}  {one:>11.1f}  {ten:>13.1f}  {(ten - one) / 9:>15.2f}")


if __name__ == "__main__":
    main()
