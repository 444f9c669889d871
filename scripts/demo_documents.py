"""Ask about two documents in turn: the paged KV cache keeps both, so only questions run.

Two module docstrings of the standard library are the documents (nothing is downloaded).
Each question goes through the chat template with its document in front; the pipeline keeps
every earlier prompt's KV blocks until the space is needed, so from the second question on a
prompt runs only the tokens after its document.  Each answer is streamed, followed by how many
prompt tokens came from the cache and the time to the first token.

    python scripts/demo_documents.py [--attention pa|sdpa] [--model DIR_OR_GGUF] \
        [--prefix-cache-tokens N] [--max-new-tokens N]

With ``--attention sdpa`` (the static-shape path) the last prompt stays in its slots and the
earlier ones' blocks go to a host store, from which a document's blocks are copied back;
``--prefix-cache-tokens 0`` turns the store off, and then a document is recomputed whenever
the other one was asked about in between.
"""

from __future__ import annotations

import argparse
import inspect
import json
import textwrap

from npuw_kv import LLMPipeline

QUESTIONS = [
    ("json", "What is this module for? One sentence."),
    ("inspect", "What is this module for? One sentence."),
    ("json", "Name one function it provides."),
    ("inspect", "Name one function it provides."),
    ("json", "Is it part of the standard library? Answer yes or no."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="auto", choices=["auto", "pa", "sdpa"])
    parser.add_argument("--model", default=None, help="IR directory or GGUF (default: SmolLM2)")
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="KV room for earlier prompts (default: 1024 paged, 2048 sdpa)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per answer")
    args = parser.parse_args()
    # room for earlier prompts, so that both documents (~1000 and ~340 tokens) stay cached:
    # beyond one sequence's MAX_PROMPT_LEN + MIN_RESPONSE_LEN tokens in the paged cache; on the
    # static-shape path a host store for both, since the slots hold only the last prompt
    room = args.prefix_cache_tokens
    if room is None:
        room = 2048 if args.attention == "sdpa" else 1024
    pipe = LLMPipeline(
        args.model, "CPU", attention_backend=args.attention, prefix_cache_tokens=room
    )
    documents = {"json": inspect.getdoc(json) or "", "inspect": inspect.getdoc(inspect) or ""}
    print(f"attention backend: {pipe.kv_stats()['kv_binding']}\n")
    for name, question in QUESTIONS:
        prompt = f"Read this document.\n\n{documents[name]}\n\n{question}"
        print(f"[{name}] {question}")
        result = pipe.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            streamer=lambda text: print(text, end="", flush=True),
        )
        stats = pipe.kv_stats()
        print(
            "\n"
            + textwrap.indent(
                f"{stats['reused_tokens']} of {result.prompt_tokens} prompt tokens from the "
                f"cache, first token after {result.ttft_s:.3f} s",
                "  -> ",
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
