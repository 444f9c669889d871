"""Build a Llama-3.2-1B-shaped model with random weights, int4 symmetric channel-wise.

Why: the figures people care about are at a size people run, and the format Intel recommends
for NPUs is int4 symmetric, channel-wise (no groups).  No model hub here, so the weights are
random (seeded); the shape is Llama 3.2 1B's (16 layers, hidden 2048, 32 query / 8 KV heads,
head_dim 64, MLP 8192, RoPE base 500000, tied embeddings) with the SmolLM2 tokenizer (vocab
49152 instead of 128256).  Speed and memory depend on the shape and the weight format, not on
the values; greedy text from random weights means nothing.

The fp16 export is made by make_tiny_optimum_ir.py's path (transformers + optimum-intel), then
nncf compresses every weight to int4 symmetric with one scale per output channel
(``CompressWeightsMode.INT4_SYM``, ``group_size=-1``, ``ratio=1.0``).  Needs the ``optimum``
extra (nncf included) and optimum-intel --no-deps.

Usage::

    python models/make_llama1b_int4.py OUT_DIR     # a few minutes; ~0.6 GiB of IR
    npuw-kv bench -m OUT_DIR --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from make_tiny_optimum_ir import _require, make_tiny_optimum_ir


def make_llama1b_int4(out_dir: str | Path, seed: int = 0) -> Path:
    """The fp16 export in ``out_dir/fp16`` (removed afterwards), its int4 form in
    ``out_dir``; returns ``out_dir``."""
    ov = _require("openvino")
    nncf = _require("nncf")
    out = Path(out_dir)
    fp16 = make_tiny_optimum_ir(
        out / "fp16",
        layers=16,
        hidden=2048,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        context=131072,
        rope_base=500000.0,
        std=0.02,
        seed=seed,
    )
    model = ov.Core().read_model(fp16 / "openvino_model.xml")
    compressed = nncf.compress_weights(
        model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=-1, ratio=1.0
    )
    ov.save_model(compressed, out / "openvino_model.xml")
    for path in fp16.iterdir():  # tokenizer IRs, configs
        if path.is_file() and not path.name.startswith("openvino_model"):
            shutil.copy2(path, out / path.name)
    shutil.rmtree(fp16)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_llama1b_int4(args.out_dir, args.seed)
    size = sum(f.stat().st_size for f in out.glob("openvino_model.*"))
    print(f"wrote {out} ({size / 2**20:.0f} MiB of model IR)")


if __name__ == "__main__":
    main()
