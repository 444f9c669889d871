"""Build realistic-size stand-ins: a model's shape with random weights, int4 or fp16.

Why: the figures people care about are at the sizes people run, and the format Intel
recommends for NPUs is int4 symmetric, channel-wise (no groups).  No model hub here, so the
weights are random (seeded) and the tokenizer is SmolLM2's; speed and memory depend on the
shape and the weight format, not on the values, and greedy text from random weights means
nothing.  Shapes:

* ``llama-3.2-1b``: 16 layers, hidden 2048, 32 query / 8 KV heads of 64, MLP 8192, RoPE base
  500000, tied embeddings; the vocabulary is the tokenizer's 49152 (not 128256).
* ``qwen2.5-0.5b``: 24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864, q/k/v
  biases, RoPE base 1000000, tied embeddings, and its 151936-entry embedding and head (the
  ids past the tokenizer's 49152 decode to nothing).
* ``lfm2-350m``: 16 layers, hidden 1024, of which 6 attention (layers 2, 5, 8, 10, 12, 14; 16
  query / 8 KV heads of 64, q/k norms) and 10 gated short convolutions (3 taps), MLP 4608
  (its block_ff_dim 6656 auto-adjusted), RoPE base 1000000, tied embeddings, its 65536-entry
  vocabulary.
* ``qwen3.5-0.8b``: Qwen3.5-0.8B's text model: 24 layers, hidden 1024, MLP 3584, every 4th
  layer gated attention (8 query / 2 KV heads of 256, RoPE on a quarter of each head, base
  10^7), the others gated DeltaNet (16 key / 16 value heads of 128, a 4-tap conv), tied
  embeddings, its 248320-entry vocabulary.

The fp16 export is make_tiny_optimum_ir.py's path (transformers + optimum-intel, as
``optimum-cli export openvino --weight-format fp16``); ``--weights int4`` then has nncf
compress every weight to int4 symmetric with one scale per output channel
(``CompressWeightsMode.INT4_SYM``, ``group_size=-1``, ``ratio=1.0``).  Needs the ``optimum``
extra (nncf included) and optimum-intel --no-deps.

Usage::

    python models/make_standin.py OUT_DIR                                # llama-3.2-1b, int4
    python models/make_standin.py OUT_DIR --shape qwen2.5-0.5b --weights fp16
    npuw-kv bench -m OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from make_tiny_optimum_ir import make_tiny_optimum_ir
from tiny_common import require as _require


def _layers(base: str, other: str, count: int, at: Iterable[int]) -> list[str]:
    """``count`` layer kinds, ``other`` at the indices ``at`` and ``base`` elsewhere."""
    marked = set(at)
    return [other if i in marked else base for i in range(count)]


SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "arch": "llama",
        "layers": 16,
        "hidden": 2048,
        "heads": 32,
        "kv_heads": 8,
        "intermediate": 8192,
        "context": 131072,
        "rope_base": 500000.0,
    },
    "qwen2.5-0.5b": {
        "arch": "qwen2.5",
        "layers": 24,
        "hidden": 896,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "context": 32768,
        "rope_base": 1000000.0,
        "rms_eps": 1e-6,
        "vocab": 151936,
    },
    "lfm2-350m": {
        "arch": "lfm2",
        "layers": 16,
        "hidden": 1024,
        "heads": 16,
        "kv_heads": 8,
        "intermediate": 4608,  # block_ff_dim 6656 auto-adjusted: 2/3 of it, up to a multiple of 256
        "context": 128000,
        "rope_base": 1000000.0,
        "vocab": 65536,
        "config_overrides": {
            "layer_types": _layers("conv", "full_attention", 16, (2, 5, 8, 10, 12, 14))
        },
    },
    "qwen3.5-0.8b": {
        "arch": "qwen3_5_text",
        "layers": 24,
        "hidden": 1024,
        "heads": 8,
        "kv_heads": 2,
        "intermediate": 3584,
        "context": 262144,
        "rms_eps": 1e-6,
        "vocab": 248320,
        "config_overrides": {
            "layer_types": _layers("linear_attention", "full_attention", 24, range(3, 24, 4)),
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": True,
        },
    },
}
WEIGHTS = ("int4", "fp16")


def make_standin(
    out_dir: str | Path, shape: str = "llama-3.2-1b", weights: str = "int4", seed: int = 0
) -> Path:
    """``shape`` with random weights in ``out_dir`` (fp16 as exported, or int4 symmetric
    channel-wise); returns ``out_dir``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHTS)}")
    out = Path(out_dir)
    if weights == "fp16":
        return make_tiny_optimum_ir(out, std=0.02, seed=seed, **SHAPES[shape])
    ov = _require("openvino")
    nncf = _require("nncf")
    fp16 = make_tiny_optimum_ir(out / "fp16", std=0.02, seed=seed, **SHAPES[shape])
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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--weights", choices=WEIGHTS, default="int4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_standin(args.out_dir, args.shape, args.weights, args.seed)
    size = sum(f.stat().st_size for f in out.glob("openvino_model.*"))
    print(f"wrote {out} ({size / 2**20:.0f} MiB of model IR)")


if __name__ == "__main__":
    main()
