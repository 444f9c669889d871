"""genai's structured-output grammars as xgrammar grammars, compiled.

openvino-genai's ``StructuredOutputConfig`` sets one grammar: a JSON schema, a regex, an EBNF
grammar, structural tags or a compound grammar built from ``StructuredOutputConfig.Regex`` /
``.JSONSchema`` / ``.EBNF`` / ``.ConstString`` / ``.AnyText`` / ``.QwenXMLParametersFormat`` /
``.Concat`` / ``.Union`` / ``.Tag`` / ``.TriggeredTags`` / ``.TagsWithSeparator`` (and the older
``StructuralTagsConfig``).  :func:`grammar_source` turns it into the text xgrammar compiles,
exactly as genai's ``xgrammar_backend.cpp`` does; :func:`compile_grammar` compiles it, turning
what xgrammar rejects into a ``ValueError`` with xgrammar's message.  xgrammar is the library
openvino-genai itself uses (built into its C++ library, not exposed to Python, so we use the
PyPI package: ``pip install 'npuw-kv[structured]'``).  The logits mask over a compiled grammar
is :mod:`npuw_kv.generation.structured`'s.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openvino_genai

from ..errors import UsageError

INSTALL_HINT = "pip install 'npuw-kv[structured]' (or: pip install xgrammar)"

# StructuredOutputConfig's grammar fields; genai allows exactly one of them to be set
GRAMMAR_FIELDS = ("json_schema", "regex", "grammar", "structural_tags_config", "compound_grammar")

# xgrammar's C++ errors start with "[12:34:56] /project/cpp/file.cc:123: " and sometimes
# "Check failed: (...) is false: "; the rest is the message meant for the user
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def xgrammar_module() -> Any:
    """The xgrammar package, or a ``ModuleNotFoundError`` naming the install command."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise ModuleNotFoundError(
            "structured output (GenerationConfig.structured_output_config) needs the xgrammar "
            f"package, which could not be imported ({exc}): {INSTALL_HINT}"
        ) from exc
    return xgr


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error without its C++ source location: the part meant for the user."""
    lines = [_XGR_PREFIX.sub("", line) for line in str(exc).strip().splitlines()]
    return " ".join(line.strip() for line in lines if line.strip()) or type(exc).__name__


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise UsageError(f"structured output: {what} is not valid JSON: {exc}") from None


def structural_tag_format(tag: Any) -> dict[str, Any]:
    """One genai structural tag (or compound grammar element) as xgrammar's JSON format,
    field for field as genai's ``to_json`` writes it (a string is taken as that JSON)."""
    soc = openvino_genai.StructuredOutputConfig
    if isinstance(tag, str):
        value = _json(tag, "a structural tag given as a string")
        if not isinstance(value, dict):
            raise UsageError(f"structured output: a structural tag must be a JSON object: {tag!r}")
        return value
    if isinstance(tag, soc.Regex):
        return {"type": "regex", "pattern": tag.value}
    if isinstance(tag, soc.JSONSchema):
        return {"type": "json_schema", "json_schema": _json(tag.value, "JSONSchema")}
    if isinstance(tag, soc.EBNF):
        return {"type": "grammar", "grammar": tag.value}
    if isinstance(tag, soc.ConstString):
        return {"type": "const_string", "value": tag.value}
    if isinstance(tag, soc.AnyText):
        return {"type": "any_text"}
    if isinstance(tag, soc.QwenXMLParametersFormat):
        schema = _json(tag.json_schema, "QwenXMLParametersFormat's json_schema")
        return {"type": "qwen_xml_parameter", "json_schema": schema}
    if isinstance(tag, soc.Concat):
        return {"type": "sequence", "elements": [structural_tag_format(e) for e in tag.elements]}
    if isinstance(tag, soc.Union):
        return {"type": "or", "elements": [structural_tag_format(e) for e in tag.elements]}
    if isinstance(tag, soc.Tag):
        content = structural_tag_format(tag.content)
        return {"type": "tag", "begin": tag.begin, "content": content, "end": tag.end}
    if isinstance(tag, soc.TriggeredTags):
        return {
            "type": "triggered_tags",
            "triggers": list(tag.triggers),
            "tags": [structural_tag_format(t) for t in tag.tags],
            "at_least_one": bool(tag.at_least_one),
            "stop_after_first": bool(tag.stop_after_first),
        }
    if isinstance(tag, soc.TagsWithSeparator):
        return {
            "type": "tags_with_separator",
            "separator": tag.separator,
            "tags": [structural_tag_format(t) for t in tag.tags],
            "at_least_one": bool(tag.at_least_one),
            "stop_after_first": bool(tag.stop_after_first),
        }
    if isinstance(tag, openvino_genai.StructuralTagsConfig):  # the deprecated form
        tags = [
            {
                "type": "tag",
                "begin": item.begin,
                "content": {"type": "json_schema", "json_schema": _json(item.schema, "a schema")},
                "end": item.end,
            }
            for item in tag.structural_tags
        ]
        return {
            "type": "triggered_tags",
            "triggers": list(tag.triggers),
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": False,
        }
    raise UsageError(f"structured output: unsupported structural tag {tag!r}")


def structural_tag_json(value: Any) -> str:
    """The structural tag JSON xgrammar compiles, for ``structural_tags_config`` /
    ``compound_grammar``; a string there is already the whole structural tag (as in genai)."""
    if isinstance(value, str):
        return value
    return json.dumps({"type": "structural_tag", "format": structural_tag_format(value)})


def grammar_source(config: Any) -> tuple[str, str]:
    """``(kind, text)`` of the one grammar ``config`` sets: kind is "json_schema", "regex",
    "ebnf" or "structural_tag"."""
    given = {name: getattr(config, name, None) for name in GRAMMAR_FIELDS}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) != 1:
        raise UsageError(
            "structured_output_config must set exactly one of "
            f"{', '.join(GRAMMAR_FIELDS)}; got {sorted(given) or 'none'}"
        )
    ((name, value),) = given.items()
    if name in ("json_schema", "regex", "grammar"):
        if not isinstance(value, str):
            raise UsageError(f"structured_output_config.{name} must be a string, got {value!r}")
        return ("ebnf" if name == "grammar" else name), value
    return "structural_tag", structural_tag_json(value)


def compile_grammar(compiler: Any, kind: str, text: str) -> Any:
    """``text`` compiled by xgrammar; what xgrammar rejects is a ``ValueError`` with its
    message.  JSON schemas compile with xgrammar's defaults, as in genai (any whitespace,
    strict: no properties beyond the schema's)."""
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(text)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        return compiler.compile_structural_tag(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        label = {"json_schema": "JSON schema", "ebnf": "EBNF grammar"}.get(kind, kind)
        raise UsageError(
            f"structured output: xgrammar rejected the {label.replace('_', ' ')}: "
            f"{xgrammar_message(exc)}"
        ) from None
