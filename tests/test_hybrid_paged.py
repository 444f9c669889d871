"""A hybrid model on the paged path: its linear-attention states in the block manager's state
slots (kv/blocks/state_slots.py) beside the KV blocks.

Qwen3.5 (a gated-DeltaNet layer with its short convolution, and an attention layer) at exact
f32: batched requests each get their tokens alone and genai's; a preempted sequence starts
again from a checkpoint or the zero state; beams fork their states (copied in the middle of an
interval, shared at a checkpoint); a prompt sharing a cached prefix starts from the checkpoint
at the last chunk boundary of it; prompt lookup rolls the state back to the accepted tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai
import pytest

import npuw_kv
from npuw_kv import LLMPipeline
from npuw_kv.api.generation_config import GenerationConfig
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.generation.token_loops import generate_batch
from npuw_kv.runtime.paged.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from conftest import shared_tiny_ir  # noqa: E402
from make_tiny_optimum_ir import make_tiny_optimum_ir  # noqa: E402

pytestmark = pytest.mark.slow(seconds=90)
PA_F32 = {"attention_backend": "pa", "kv_precision": "f32", **EXACT_F32}
NEW = 12


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_5") / "ir"  # the family matrix's export (shared)
    return shared_tiny_ir(tmp_path_factory, out, arch="qwen3_5_text", std=0.3, seed=3, keep_hf=True)


@pytest.fixture(scope="module")
def pipe(hybrid_dir) -> LLMPipeline:
    return LLMPipeline(hybrid_dir, "CPU", max_prompt_len=512, **PA_F32)


def _prompt(n: int, step: int = 37) -> np.ndarray:
    return (np.arange(n) * step) % 5000 + 50


def _genai(hybrid_dir: Path, ids: np.ndarray, **config: object) -> list[list[int]]:
    pipe = openvino_genai.LLMPipeline(str(hybrid_dir), "CPU", KV_CACHE_PRECISION="f32", **EXACT_F32)
    settings = openvino_genai.GenerationConfig()
    settings.max_new_tokens, settings.ignore_eos = NEW, True
    for key, value in config.items():
        setattr(settings, key, value)
    return [list(map(int, t)) for t in pipe.generate(ov.Tensor(ids[None]), settings).tokens]


def _alone(pipe: LLMPipeline, ids: np.ndarray, new: int = NEW) -> list[int]:
    return list(pipe.generate([int(t) for t in ids], max_new_tokens=new, ignore_eos=True).tokens)


def test_batched_requests_each_get_their_tokens_alone_and_genais(pipe, hybrid_dir):
    text = _prompt(460)
    prompts = [text[:300], _prompt(40, 11), np.concatenate([text[:280], _prompt(30, 5)]), text]
    alone = [_alone(pipe, p) for p in prompts]
    assert alone[0] == _genai(hybrid_dir, prompts[0])[0]
    assert alone[3] == _genai(hybrid_dir, prompts[3])[0]
    pipe.runner.forget_prefixes()
    configs = [GenerationConfig(max_new_tokens=NEW, ignore_eos=True)] * len(prompts)
    batched = generate_batch(Scheduler(pipe.runner, 8), pipe.tokenizer, prompts, configs)
    assert [list(r[0].tokens) for r in batched] == alone
    stats = pipe.kv_stats()
    assert stats["state_checkpoint_interval"] == 256
    assert stats["state_slots_used"] >= stats["state_checkpoints"] > 0


def test_a_shared_prefix_starts_from_the_checkpoint_at_its_last_chunk_boundary(pipe, hybrid_dir):
    text = _prompt(300)
    other = np.concatenate([text[:290], _prompt(20, 3)])  # 310 tokens, 290 shared
    pipe.runner.forget_prefixes()
    cold = _alone(pipe, other)
    pipe.runner.forget_prefixes()
    _alone(pipe, text)
    reused_before = pipe.kv_stats()["state_checkpoints_reused"]
    assert _alone(pipe, other) == cold == _genai(hybrid_dir, other)[0]
    stats = pipe.kv_stats()
    # the KV blocks hold 288 shared tokens; the state is checkpointed at 256
    assert stats["reused_tokens"] == 256
    assert stats["state_checkpoints_reused"] == reused_before + 1


def test_a_finer_checkpoint_interval_serves_a_shorter_shared_prefix(hybrid_dir):
    """``state_checkpoint_interval`` (genai's ``cache_interval_multiplier`` x 32): checkpoints
    every 64 tokens, inside a 256-token chunk, so a prompt sharing 230 tokens starts from the
    one at 192 (with one per chunk it would start from nothing)."""
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_interval_multiplier, scheduler.enable_prefix_caching = 2, True
    fine = npuw_kv.ContinuousBatchingPipeline(
        hybrid_dir, scheduler, "CPU", {"max_prompt_len": 512, **PA_F32}
    )
    pipe = LLMPipeline(fine.engine)
    text = _prompt(300)
    other = np.concatenate([text[:230], _prompt(40, 3)])
    cold = _alone(pipe, other)
    pipe.runner.forget_prefixes()
    _alone(pipe, text)
    assert _alone(pipe, other) == cold == _genai(hybrid_dir, other)[0]
    stats = pipe.kv_stats()
    assert stats["state_checkpoint_interval"] == 64
    assert stats["reused_tokens"] == 192


def test_preempted_sequences_start_again_from_their_states(hybrid_dir):
    small = LLMPipeline(hybrid_dir, "CPU", max_prompt_len=512, prefix_cache_tokens=64, **PA_F32)
    # two ~330-token prompts fill the room's blocks; decoding 30 tokens more each needs more
    prompts = [_prompt(n, step) for n, step in [(330, 3), (335, 5), (340, 7), (325, 9)]]
    alone = [_alone(small, p, 30) for p in prompts]
    configs = [GenerationConfig(max_new_tokens=30, ignore_eos=True)] * len(prompts)
    small.runner.forget_prefixes()
    scheduler = Scheduler(small.runner, 8)
    batched = generate_batch(scheduler, small.tokenizer, prompts, configs)
    assert [list(r[0].tokens) for r in batched] == alone
    assert scheduler.stats.preemptions > 0


def test_beams_fork_their_states_as_genais_beams(pipe, hybrid_dir):
    ids = _prompt(270)
    config = {"num_beams": 3, "num_return_sequences": 3}
    ours = pipe.generate(ov.Tensor(ids[None]), max_new_tokens=NEW, ignore_eos=True, **config)
    assert [list(t) for t in ours.tokens] == _genai(hybrid_dir, ids, **config)
    assert pipe.kv_stats()["state_copied_bytes"] > 0  # forks in the middle of an interval


def test_a_verify_is_cut_back_to_the_state_after_its_accepted_tokens(pipe):
    ids = _prompt(100)
    runner = pipe.runner
    runner.prefill(ids)
    runner.verify([7, 8, 9, 10])
    runner.truncate(102)  # two candidates kept
    got = runner.step(11)
    with pytest.raises(ValueError, match="state after 50 tokens is not kept"):
        runner.truncate(50)
    runner.prefill(np.concatenate([ids, [7, 8]]))
    np.testing.assert_array_equal(got, runner.step(11))


def test_a_draft_models_rejected_candidates_are_rolled_back(pipe, hybrid_dir, tmp_path_factory):
    """Speculative decoding with another random Qwen3.5 as the draft (a hybrid too: its own
    catch-up cannot cut its state back, so it reruns): the target's tokens are greedy's, its
    state rolled back past every rejected candidate."""
    ids = _prompt(120)
    want = _alone(pipe, ids)
    other = make_tiny_optimum_ir(tmp_path_factory.mktemp("draft"), arch="qwen3_5_text", seed=4)
    draft = LLMPipeline(
        hybrid_dir,
        "CPU",
        max_prompt_len=512,
        draft_model=npuw_kv.draft_model(other, "CPU", **PA_F32),
        **PA_F32,
    )
    got = draft.generate(
        [int(t) for t in ids], max_new_tokens=NEW, ignore_eos=True, num_assistant_tokens=3
    )
    assert list(got.tokens) == want
    stats = draft.kv_stats()["speculative"]
    assert stats["candidates"] > stats["accepted"]


def test_a_checkpoint_interval_is_whole_blocks_and_said_idle_without_states(hybrid_dir, smol_dir):
    with pytest.raises(ValueError, match="state_checkpoint_interval .* whole KV blocks of 32"):
        LLMPipeline(hybrid_dir, "CPU", state_checkpoint_interval=48, **PA_F32)
    with pytest.warns(RuntimeWarning, match="state_checkpoint_interval .* no effect"):
        plain = LLMPipeline(smol_dir, "CPU", state_checkpoint_interval=64, **PA_F32)
    assert len(plain.generate("Hi", max_new_tokens=2).tokens) == 2
