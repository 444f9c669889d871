"""What each part of the CPU's defaults costs against the f32 reference, one at a time.

``device-default`` in ``npuw-kv accuracy`` changes three things at once: u8 KV blocks, bf16
compute and int8 dynamic quantization of activations.  This runs the accuracy tool's matrix on
the PagedAttention path with the parts switched on separately (reported, never gated).

    python scripts/accuracy_variants.py [--prompt-lens 1024,4096] [--chunk 256]
"""

from __future__ import annotations

import argparse

from npuw_kv.accuracy import run
from npuw_kv.accuracy.report import table
from npuw_kv.model.source import resolve_model

F32 = {"INFERENCE_PRECISION_HINT": "f32"}
NO_DQ = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
VARIANTS = {
    "u8-kv": {**F32, **NO_DQ, "kv_precision": "u8"},
    "u8-kv+dyn-quant": {**F32, "kv_precision": "u8"},
    "u8-kv+bf16": {**NO_DQ, "kv_precision": "u8"},
    "bf16-kv+bf16": {**NO_DQ, "kv_precision": "bf16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", default="1024,4096")
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    for name, settings in VARIANTS.items():
        run.MODES[name] = {"attention_backend": "pa", **settings}
    results = run.run_matrix(
        resolve_model(None),
        [int(n) for n in args.prompt_lens.split(",")],
        64,
        ["CPU"],
        list(VARIANTS),
        [args.chunk],
        peer=False,
    )
    print(table(results))


if __name__ == "__main__":
    main()
