"""A GGUF whose tokenizer metadata contradicts itself is refused at conversion and nothing is
cached (issue #57): openvino-genai converts it without a word, and every prompt then failed with
"the tokenizer could not take this text: unordered_map::at".  A chat template that fails keeps
its own message (a template's ``raise_exception('...')`` text), not only Minja's caret line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import openvino_genai
import pytest

from npuw_kv import ModelSourceError
from npuw_kv.api.encoding import PromptEncoder
from npuw_kv.errors import UsageError
from npuw_kv.model.cache_entry import entry_problem
from npuw_kv.model.gguf_check import check_gguf
from npuw_kv.model.gguf_tokenizer import (
    CONTROL,
    PROBES,
    converted_tokenizer_problem,
    template_message,
    tokenizer_problem,
)
from npuw_kv.model.ir_cache import IR_FILES, TOKENIZER_FILES
from npuw_kv.model.source import convert_gguf
from npuw_kv.pipeline import LLMPipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_tiny_gguf import make_tiny_gguf  # noqa: E402

RAISING = "{{ raise_exception('only user and assistant roles') }}"
UNCLOSED = "{% for m in messages %}{{ m['content'] }"
Metadata = dict[str, list[Any]]  # key -> [value, type, item type]


def quiet(*args: object, **kwargs: object) -> None:
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> gguf.GGUFReader:
    """The smallest tiny Llama (SmolLM2's tokenizer metadata), read once: variants are
    written from it in a fraction of a second."""
    folder = tmp_path_factory.mktemp("tiny")
    shape = {"layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "intermediate": 64}
    return check_gguf(make_tiny_gguf(folder / "tiny.gguf", dtype="Q8_0", **shape))


def variant(reader: gguf.GGUFReader, out: Path, edit: Callable[[Metadata], None]) -> Path:
    """A copy of the tiny GGUF, its metadata changed by ``edit`` (tensors as they are)."""
    metadata: Metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer adds these
            continue
        item = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        metadata[key] = [field.contents(), field.types[0], item]
    edit(metadata)
    writer = gguf.GGUFWriter(out, "llama")
    for key, (value, kind, item) in metadata.items():
        writer.add_key_value(key, value, kind, item)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def unchanged(metadata: Metadata) -> None:
    pass


def merge_of_missing_pieces(metadata: Metadata) -> None:
    metadata["tokenizer.ggml.merges"][0].insert(0, "Hzz qq")


def piece_renamed(metadata: Metadata) -> None:
    """The piece "H" gone from the vocabulary while the merges still build on it."""
    tokens = metadata["tokenizer.ggml.tokens"][0]
    tokens[tokens.index("H")] = "XXXH"


def every_piece_control(metadata: Metadata) -> None:
    """Control pieces are skipped when decoding: every reply would be empty."""
    types = metadata["tokenizer.ggml.token_type"][0]
    metadata["tokenizer.ggml.token_type"][0] = [CONTROL] * len(types)


def raising_template(metadata: Metadata) -> None:
    metadata["tokenizer.chat_template"][0] = RAISING


# name -> (the change to the metadata, what the error says)
INCONSISTENT: dict[str, tuple[Callable[[Metadata], None], str]] = {
    "a merge of pieces the vocabulary lacks": (
        merge_of_missing_pieces,
        "encoding 'Hello there' fails (unordered_map::at)",
    ),
    "a piece renamed under its merges": (
        piece_renamed,
        "encoding 'Hello there' fails (unordered_map::at)",
    ),
    "every piece typed control": (every_piece_control, "decode to no text"),
    "a chat template that raises": (
        raising_template,
        "its chat template fails on a one-message chat: only user and assistant roles",
    ),
}


def refused(gguf_path: Path, cache: Path) -> str:
    """The conversion's one-line error; the cache holds no entry and no work folder after it."""
    with pytest.raises(ModelSourceError) as info:
        convert_gguf(gguf_path, cache, log=quiet)
    message = str(info.value)
    assert message.startswith(f"could not convert {gguf_path}: its tokenizer metadata is ")
    assert "\n" not in message and message.endswith("; nothing was cached")
    assert not [p for p in cache.iterdir() if p.is_dir()]
    return message


@pytest.fixture(scope="module")
def tiny_ir(tiny, tmp_path_factory) -> Path:
    """The unchanged copy, converted: what the variants are measured against."""
    folder = tmp_path_factory.mktemp("unchanged")
    return convert_gguf(variant(tiny, folder / "tiny.gguf", unchanged), folder / "cache", quiet)


# --- the conversion check ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(INCONSISTENT))
def test_inconsistent_tokenizer_metadata_is_refused_and_not_cached(case, tiny, tmp_path):
    edit, phrase = INCONSISTENT[case]
    bad = variant(tiny, tmp_path / "bad.gguf", edit)
    assert phrase in refused(bad, tmp_path / "cache")


def test_a_refused_gguf_is_tried_again_not_served_from_the_cache(tiny, tmp_path):
    bad = variant(tiny, tmp_path / "bad.gguf", merge_of_missing_pieces)
    first = refused(bad, tmp_path / "cache")
    assert refused(bad, tmp_path / "cache") == first


def test_the_unchanged_copy_converts_and_round_trips_exactly(tiny_ir, smol_dir):
    """The tokenizers of the tiny GGUFs and of SmolLM2 give back every probe as it was (the
    check itself asks only for some text back)."""
    assert entry_problem(tiny_ir, IR_FILES + TOKENIZER_FILES) is None
    for folder in (tiny_ir, smol_dir):
        assert converted_tokenizer_problem(folder) is None
        tokenizer = openvino_genai.Tokenizer(str(folder))
        for text in PROBES:
            ids = tokenizer.encode(text, add_special_tokens=False).input_ids.data.reshape(-1)
            assert tokenizer.decode(ids.tolist()) == text


def test_tokenizer_ir_files_that_do_not_load_are_named(tiny_ir, tmp_path):
    for name in TOKENIZER_FILES:
        (tmp_path / name).write_bytes((tiny_ir / name).read_bytes())
    (tmp_path / "openvino_tokenizer.xml").write_text("<net>")
    assert converted_tokenizer_problem(tmp_path).startswith("its tokenizer IRs do not load (")


class FakeTokenizer:
    """An ``openvino_genai.Tokenizer`` stand-in: ``ids`` per text, ``decoded`` for any ids."""

    def __init__(self, ids: list[int], decoded: str = "x", template: str = "") -> None:
        self.ids, self.decoded, self.chat_template = ids, decoded, template

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        assert not add_special_tokens  # a BOS alone would hide an empty encoding
        return SimpleNamespace(input_ids=SimpleNamespace(data=np.array([self.ids], np.int64)))

    def decode(self, ids: list[int]) -> str:
        if self.decoded == "raise":
            raise RuntimeError("Exception from src/x.cpp:1:\nbad ids")
        return self.decoded

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        if self.chat_template == "raise":
            raise RuntimeError(f"Minja's error: no system role at row 1, column 4:\n{RAISING}\n^")
        return "<user>" + messages[0]["content"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tokenizer", "problem"),
    [
        (FakeTokenizer([]), "encoding 'Hello there' gives no token ids"),
        (FakeTokenizer([5], decoded="raise"), "decoding the ids of 'Hello there' fails (bad ids)"),
        (FakeTokenizer([5], decoded=" "), "the ids of 'Hello there' ([5]) decode to no text"),
        (
            FakeTokenizer([5], template="raise"),
            "its chat template fails on a one-message chat: no system role (at row 1, column 4 "
            "of the template)",
        ),
        (FakeTokenizer([5], template="{{ x }}"), None),
        (FakeTokenizer([5]), None),
    ],
)
def test_what_the_check_refuses(tokenizer, problem):
    assert tokenizer_problem(tokenizer) == problem


# --- a failing chat template's own message -------------------------------------------------

# openvino-genai 2026.4's errors for a template's raise_exception and for a syntax error
GENAI_RAISE = (
    "Exception from src/cpp/src/tokenizer/tokenizer_impl.cpp:855:\n"
    "Minja failed to apply chat template. Possible solutions are\n"
    "* Provide a simplified chat template with set_chat_template().\n"
    "Minja's error: only user and assistant roles at row 1, column 57:\n"
    "{% if x %}{{ raise_exception('only user and assistant roles') }}{% endif %}\n"
    "                                                        ^\n"
    " at row 1, column 1:\n{% if x %}\n^\n\n"
)
GENAI_SYNTAX = f"Expected closing expression tag at row 1, column 40:\n{UNCLOSED}\n{' ' * 39}^\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (GENAI_RAISE, "only user and assistant roles (at row 1, column 57 of the template)"),
        (GENAI_SYNTAX, "Expected closing expression tag (at row 1, column 40 of the template)"),
        ("Exception from a.cpp:1:\n" + GENAI_SYNTAX, "Expected closing expression tag (at row"),
        ("Chat template wasn't found.", "Chat template wasn't found."),
        ("Minja's error: two\nlines at row 2, column 3:\nx\n^", "two lines (at row 2, column 3"),
    ],
)
def test_template_message_reads_genais_error(text, message):
    assert template_message(RuntimeError(text)).startswith(message)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (RAISING, "only user and assistant roles (at row 1, column 19 of the template)"),
        (UNCLOSED, "Expected closing expression tag (at row 1, column 40 of the template)"),
    ],
)
def test_a_failing_chat_template_keeps_its_message(smol_dir, template, message):
    tokenizer = openvino_genai.Tokenizer(str(smol_dir))  # its own: the template is changed
    tokenizer.set_chat_template(template)
    with pytest.raises(UsageError) as info:
        PromptEncoder(tokenizer).messages([{"role": "user", "content": "Hello there"}])
    assert str(info.value) == f"the chat template failed: {message}"


def test_the_pipelines_chat_template_error_keeps_its_message(tiny_ir):
    pipe = LLMPipeline(tiny_ir, "CPU")
    pipe.get_tokenizer().set_chat_template(RAISING)
    with pytest.raises(UsageError, match=r"chat template failed: only user and assistant roles"):
        pipe.generate("Hello there", max_new_tokens=2)
    # the pipeline stays usable: raw text does not go through the template
    raw = pipe.generate("Hello there", max_new_tokens=2, ignore_eos=True, apply_chat_template=False)
    assert len(raw.tokens) == 2


# a template that wants a user turn after the system message (as several chat models' do)
USER_NEEDED = (
    "{% if messages|length == 1 %}{{ raise_exception('a user turn must follow') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_refusing_a_lone_system_message_still_serves_the_chat(tiny_ir):
    """The paged path templates the system message alone too, to hold its KV cached longest:
    a template that refuses that chat costs the hold, not the call."""
    pipe = LLMPipeline(tiny_ir, "CPU", attention_backend="pa")
    pipe.get_tokenizer().set_chat_template(USER_NEEDED)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    answer = pipe.generate(chat, max_new_tokens=2, ignore_eos=True)
    assert answer.perf_metrics.get_num_generated_tokens() == 2
    with pytest.raises(UsageError, match="a user turn must follow"):
        pipe.generate([chat[0]], max_new_tokens=2)
