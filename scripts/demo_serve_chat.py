#!/usr/bin/env python3
"""Chat with ``npuw-kv serve`` through the official ``openai`` client, streaming the answers.

Without ``--url`` it starts a server on the shipped model itself (and stops it at the end);
with ``--url`` it talks to one already running (``npuw-kv serve`` prints its URL).  The
conversation is kept on the client side, as with any OpenAI-compatible server: each turn sends
the whole history.

    python scripts/demo_serve_chat.py                          # a scripted three-turn chat
    python scripts/demo_serve_chat.py --interactive            # your own questions
    python scripts/demo_serve_chat.py --url http://127.0.0.1:8000/v1 --api-key KEY
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import openai

from npuw_kv.serve.child import ServeProcess

SCRIPT = [
    "What is OpenVINO in one sentence?",
    "Name two things a laptop's NPU is good at.",
    "Thanks! Summarise our chat in five words.",
]


def turns(interactive: bool):
    if not interactive:
        yield from SCRIPT
        return
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            return
        if line in ("", "/quit", "/exit"):
            return
        yield line


def chat(client: Any, model: str, questions, max_tokens: int, echo: bool) -> None:
    history = [{"role": "system", "content": "You are a brief, helpful assistant."}]
    for question in questions:
        if echo:  # a scripted question: shown as if typed
            print(f"you> {question}")
        history.append({"role": "user", "content": question})
        stream = client.chat.completions.create(
            model=model, messages=history, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, frequency_penalty=0.5,
        )  # fmt: skip
        answer, usage = [], None
        print("assistant> ", end="", flush=True)
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                answer.append(chunk.choices[0].delta.content)
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
        if usage is not None:
            print(f"  [{usage.prompt_tokens} prompt + {usage.completion_tokens} answer tokens]",
                  file=sys.stderr)  # fmt: skip
        history.append({"role": "assistant", "content": "".join(answer)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running server's /v1 URL")
    parser.add_argument("--api-key", default="none", help="its --api-key, if it has one")
    parser.add_argument("--interactive", action="store_true", help="ask your own questions")
    parser.add_argument("--max-tokens", "-n", type=int, default=96)
    args = parser.parse_args()
    server = None
    if args.url is None:
        print("starting npuw-kv serve on the shipped model ...", file=sys.stderr)
        server = ServeProcess()
        args.url = server.url
    try:
        client = openai.OpenAI(base_url=args.url, api_key=args.api_key, timeout=600)
        model = client.models.list().data[0].id
        print(f"talking to {model} at {args.url}", file=sys.stderr)
        chat(client, model, turns(args.interactive), args.max_tokens, not args.interactive)
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped (exit code {code})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
