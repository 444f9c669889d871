"""lm-eval's ``local-completions`` at its defaults against ``npuw-kv serve``: token-id prompts,
``echo`` with ``logprobs`` (the prompt's own log-probabilities), more than 4 stop strings.

The tasks are tests/data/lm_eval_tasks (a loglikelihood, a multiple-choice and a generate_until
task, a few docs each); lm-eval reads the model's tokenizer from a local HF copy (rebuilt from
the GGUF, offline).  Every loglikelihood lm-eval reports equals the sum of the continuation's
log-probabilities under the model's own logits (the original stateful IR, every row, exact f32)
to 1e-4, and each generation equals the library's for the same ids and stop strings.  lm-eval
missing is a failure, not a skip: ``pip install 'lm-eval[api]'``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from npuw_kv.serve.child import ServeProcess

pytestmark = pytest.mark.slow(seconds=90)

TASKS = Path(__file__).parent / "data" / "lm_eval_tasks"
NAMES = ("npuw_kv_lastword", "npuw_kv_choice", "npuw_kv_answer")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as transformers reads it, rebuilt from the GGUF (no hub)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from make_tiny_optimum_ir import build_smollm2_tokenizer

    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    build_smollm2_tokenizer().save_pretrained(out)
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The ids lm-eval sends for a loglikelihood request (its TemplateLM's pairing: trailing
    spaces of the context go to the continuation, the whole encoded then split)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    head = tokenizer(context, add_special_tokens=False).input_ids
    return head, whole[len(head) :]


def run_lm_eval(
    server: ServeProcess, tokenizer: Path | None, out: Path, names: tuple[str, ...] = NAMES
) -> subprocess.CompletedProcess:
    """``lm-eval run`` with local-completions and no setting but where the server and the
    tokenizer are (and the shipped tasks), offline; no tokenizer: the server's own
    (``tokenizer_backend=remote``)."""
    args = f"model=smollm2,base_url={server.url}/completions"
    args += f",tokenizer={tokenizer}" if tokenizer else ",tokenizer_backend=remote"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets"),
    }
    command = [
        sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
        "--model_args", args, "--tasks", ",".join(names), "--include_path", str(TASKS),
        "--output_path", str(out / "results"), "--log_samples",
    ]  # fmt: skip
    # the tasks' data files are named relative to their folder
    return subprocess.run(
        command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def samples(out: Path, names: tuple[str, ...] = NAMES) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for name in names:
        (path,) = (out / "results").rglob(f"samples_{name}_*.jsonl")
        found[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def test_lm_eval_local_completions_at_its_defaults(
    exact_server, hf_tokenizer, prompt_logprobs_reference, f32_pipe, tmp_path
):
    assert importlib.util.find_spec("lm_eval") is not None, (
        "lm-eval is not installed: pip install 'lm-eval[api]'"
    )
    from transformers import AutoTokenizer

    done = run_lm_eval(exact_server, hf_tokenizer, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    assert set(NAMES) <= set(results["results"]), results["results"]
    tokenizer = AutoTokenizer.from_pretrained(hf_tokenizer)
    found = samples(tmp_path)
    checked = 0
    for name in ("npuw_kv_lastword", "npuw_kv_choice"):
        for sample in found[name]:
            for request, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
                context, ids = encode_pair(tokenizer, request["arg_0"], request["arg_1"])
                logprob, greedy = float(resp[0][0]), resp[0][1] == "True"
                scores, likeliest = prompt_logprobs_reference(context + ids)
                reference = scores[len(context) - 1 :]
                assert abs(logprob - reference.sum()) <= 1e-4, (name, request, logprob, reference)
                assert greedy == (likeliest[len(context) - 1 :] == ids).all(), (name, request)
                checked += 1
    assert checked == 4 + 4 * 3  # every loglikelihood request of the two tasks
    for sample in found["npuw_kv_answer"]:
        request = sample["arguments"]["gen_args_0"]
        until = [*request["arg_1"]["until"], tokenizer.eos_token]  # lm-eval adds the EOS text
        assert len(until) > 4
        ids = tokenizer(request["arg_0"], add_special_tokens=False).input_ids
        expected = f32_pipe.generate(
            ids, max_new_tokens=request["arg_1"]["max_gen_toks"], stop_strings=set(until)
        )
        assert sample["resps"][0][0] == expected.text, request


def test_echo_logprobs_shape_and_batched_scores(exact_server, prompt_logprobs_reference, text_ids):
    """Prompts as one id list and as a list of them, scored with max_tokens 0, several
    requests at once (their prompts read in the same batched steps): each token's
    log-probability as the reference's, the first null, offsets over prompt and answer."""
    prompts = [[int(t) for t in text_ids(n)] for n in (7, 40, 300, 19)]
    replies: dict[int, dict] = {}

    def ask(i: int) -> None:
        body = {"model": "smollm2", "prompt": prompts[i], "echo": True, "logprobs": 2}
        body["max_tokens"] = 0 if i % 2 else 3
        with httpx.Client(base_url=exact_server.url, timeout=300) as client:
            replies[i] = client.post("/completions", json=body).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(prompts):
        (choice,) = replies[i]["choices"]
        logprobs = choice["logprobs"]
        answer = 0 if i % 2 else 3
        assert replies[i]["usage"]["completion_tokens"] <= answer
        n = len(ids) + replies[i]["usage"]["completion_tokens"]
        assert [len(logprobs[k]) for k in logprobs] == [n] * 4
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        got = np.array(logprobs["token_logprobs"][1 : len(ids)])
        assert np.abs(got - prompt_logprobs_reference(ids)[0]).max() <= 1e-4
        tops = logprobs["top_logprobs"][1 : len(ids)]
        for top, chosen in zip(tops, got, strict=True):
            assert len(top) <= 2 and max(top.values()) >= chosen
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
    both = {"model": "smollm2", "prompt": [prompts[0], prompts[3]], "echo": True, "logprobs": 0}
    with httpx.Client(base_url=exact_server.url, timeout=300) as client:
        reply = client.post("/completions", json={**both, "max_tokens": 0}).json()
    for choice, ids in zip(reply["choices"], (prompts[0], prompts[3]), strict=True):
        got = np.array(choice["logprobs"]["token_logprobs"][1:])
        assert len(got) == len(ids) - 1
        assert np.abs(got - prompt_logprobs_reference(ids)[0]).max() <= 1e-4


def test_lm_eval_with_the_servers_tokenizer(exact_server, hf_tokenizer, tmp_path):
    """``tokenizer_backend=remote``: lm-eval tokenizes through the server (/tokenizer_info,
    /tokenize, /detokenize), so a model with no Hugging Face tokenizer is evaluated too; its
    ids and loglikelihoods are those of the run with the local copy."""
    from lm_eval.utils import RemoteTokenizer
    from transformers import AutoTokenizer

    remote = RemoteTokenizer(f"{exact_server.url}/completions")  # as lm-eval makes it
    local = AutoTokenizer.from_pretrained(hf_tokenizer)
    text = "The Sun is yellow because"
    assert remote.encode(text) == local(text, add_special_tokens=False).input_ids
    assert remote.decode(remote.encode(text)) == text
    assert remote.eos_token == local.eos_token and remote.eos_token_id == local.eos_token_id
    names = ("npuw_kv_lastword",)
    runs = {}
    for label, tokenizer in (("remote", None), ("local", hf_tokenizer)):
        done = run_lm_eval(exact_server, tokenizer, tmp_path / label, names)
        assert done.returncode == 0, done.stderr[-4000:]
        runs[label] = samples(tmp_path / label, names)["npuw_kv_lastword"]
    for ours, theirs in zip(runs["remote"], runs["local"], strict=True):
        assert ours["resps"] == theirs["resps"]
