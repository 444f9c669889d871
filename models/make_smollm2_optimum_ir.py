"""Export the shipped SmolLM2 GGUF as an optimum-intel IR directory (fp16 weights).

Why: NPUW's own LLM pipeline cannot compile the IR that openvino-genai makes from the GGUF,
so comparing against NPUW (``npuw-kv accuracy``'s ``npuw-llm`` peer) needs the same weights in
the form NPUW is built for: an optimum-intel export.  transformers dequantizes the GGUF's Q4_1
tensors when it loads them; the export stores them as fp16.  The tokenizer is the one rebuilt
from the GGUF metadata (see make_tiny_optimum_ir.py for why not transformers' own).

Needs what make_tiny_optimum_ir.py needs (the ``optimum`` extra, optimum-intel --no-deps).

Usage::

    python models/make_smollm2_optimum_ir.py OUT_DIR      # ~1 min, ~280 MiB
    npuw-kv accuracy --model OUT_DIR --devices NPU --modes f16-kv
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from make_tiny_optimum_ir import _require, build_smollm2_tokenizer, export_hf_dir
from tiny_common import smollm2_gguf_path


def make_smollm2_optimum_ir(out_dir: str | Path) -> Path:
    transformers = _require("transformers")
    _require("gguf")
    gguf = smollm2_gguf_path()
    out = Path(out_dir)
    hf_dir = out / "hf"
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype="float32"
    )
    # the weights are plain floats now: a GGUF quantization_config would make the export
    # look for a quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.do_sample = False
    model.save_pretrained(hf_dir)
    build_smollm2_tokenizer().save_pretrained(hf_dir)
    export_hf_dir(hf_dir, out)
    shutil.rmtree(hf_dir)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    out = make_smollm2_optimum_ir(parser.parse_args(argv).out_dir)
    size = sum(f.stat().st_size for f in out.glob("openvino_*"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB of IR)")


if __name__ == "__main__":
    main()
