"""The files behind openvino_genai's opaque objects: its ``Adapter`` and ``draft_model(...)``.

genai's ``Adapter`` holds its LoRA matrices in C++ and ``draft_model(path, device)`` returns an
``OVAny`` holding a C++ model description; Python can read neither.  Two ways lead back to
their files:

* objects made once npuw_kv is imported are recorded when made (``openvino_genai.Adapter`` and
  ``draft_model`` are wrapped; genai's own pipelines take the objects as before):
  :func:`record_genai_adapters` here, ``generation.draft.record_genai_drafts`` for drafts;
* objects made before: genai keeps the files it read mapped into memory while the object
  lives (a draft's ``openvino_model.bin`` and tokenizer, an adapter's safetensors file), which
  ``/proc/self/maps`` lists (Linux).  When exactly one such file (or model directory) is
  mapped, it is the object's; otherwise the object is refused naming the candidates.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

MAPS = Path("/proc/self/maps")
# genai Adapters made since npuw_kv was imported, and the file each was read from
_ADAPTERS: dict[int, tuple[weakref.ref[Any], Path]] = {}
_ADAPTER_CLASSES: list[type] = []


def mapped_files() -> set[Path]:
    """Files mapped into this process now (empty where ``/proc`` has no maps)."""
    try:
        text = MAPS.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    out = set()
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(Path(parts[5]))
    return out


def mapped_model_dirs() -> list[Path]:
    """Model directories whose weights and tokenizer are both mapped (a genai draft model,
    or another pipeline holding its model)."""
    files = mapped_files()
    dirs = {f.parent for f in files if f.name == "openvino_model.bin"}
    return sorted(
        d
        for d in dirs
        if d / "openvino_tokenizer.bin" in files and (d / "openvino_model.xml").is_file()
    )


def record_genai_adapters() -> None:
    """Make ``openvino_genai.Adapter`` a subclass that remembers the file each adapter was
    read from (genai's pipelines and ``AdapterConfig`` take its objects as genai's own)."""
    import openvino_genai

    original = openvino_genai.Adapter
    if original in _ADAPTER_CLASSES:  # recorded already
        return

    class Adapter(original):  # type: ignore[misc, valid-type]
        __doc__ = original.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            path = args[0] if args else kwargs.get("path")
            if isinstance(path, (str, bytes, os.PathLike)):
                key = id(self)
                _ADAPTERS[key] = (weakref.ref(self), Path(os.fsdecode(path)))
                weakref.finalize(self, _ADAPTERS.pop, key, None)

    Adapter.__module__ = original.__module__
    Adapter.__qualname__ = original.__qualname__
    _ADAPTER_CLASSES.append(Adapter)
    openvino_genai.Adapter = Adapter


def genai_adapter_paths(config: Any) -> list[tuple[Path, float]]:
    """The files and alphas of a genai ``AdapterConfig``'s adapters, in its order; a
    ``UsageError`` when an adapter's file cannot be told."""
    from ..errors import UsageError

    pairs = list(config.get_adapters_and_alphas())
    known: list[Path | None] = []
    for adapter, _ in pairs:
        found = None
        for ref, path in list(_ADAPTERS.values()):
            recorded = ref()
            if recorded is None:
                continue
            try:  # genai compares adapters by what they hold: the copy it returns is found
                config.get_alpha(recorded)
            except RuntimeError:
                continue
            if _same_adapter(config, recorded, adapter):
                found = path
                break
        known.append(found)
    unknown = [i for i, path in enumerate(known) if path is None]
    if unknown:
        claimed = {p for p in known if p is not None}
        mapped = sorted(
            f for f in mapped_files() if f.suffix == ".safetensors" and f not in claimed
        )
        if len(unknown) != 1 or len(mapped) != 1:
            raise UsageError(
                "adapters: openvino_genai's Adapter does not expose its file, and "
                f"{len(unknown)} of this AdapterConfig's adapters were made before npuw_kv "
                f"could record them, with {len(mapped)} safetensors files mapped "
                f"({', '.join(map(str, mapped)) or 'none'}): import npuw_kv before making "
                "them, or use npuw_kv.Adapter(path)"
            )
        known[unknown[0]] = mapped[0]
    return [(path, float(alpha)) for path, (_, alpha) in zip(known, pairs, strict=True) if path]


def _same_adapter(config: Any, recorded: Any, adapter: Any) -> bool:
    """Whether two genai adapters are one (genai's objects have no ``==``): setting the alpha
    of one changes the other's in ``config`` (set back at once)."""
    before = config.get_alpha(adapter)
    probe = 12345.0 if before != 12345.0 else 54321.0  # exact in float32
    config.set_alpha(recorded, probe)
    try:
        return bool(config.get_alpha(adapter) == probe)
    finally:
        config.set_alpha(recorded, before)


# our Adapter read for each file a genai adapter came from, while something holds it: a
# call's genai AdapterConfig then picks the adapters the pipeline registered
_OURS: weakref.WeakValueDictionary[Path, Any] = weakref.WeakValueDictionary()


def our_adapter(path: Path) -> Any:
    """Our ``Adapter`` of ``path``: the one read already while it lives, else read now."""
    from .adapters import Adapter

    adapter = _OURS.get(path)
    if adapter is None:
        adapter = _OURS[path] = Adapter(path)
    return adapter


def genai_adapter_path(adapter: Any) -> Path:
    """The file one genai ``Adapter`` object was read from (recorded, or the one mapped)."""
    from ..errors import UsageError

    entry = _ADAPTERS.get(id(adapter))
    if entry is not None and entry[0]() is adapter:
        return entry[1]
    mapped = sorted(f for f in mapped_files() if f.suffix == ".safetensors")
    if len(mapped) != 1:
        raise UsageError(
            "adapters: openvino_genai's Adapter does not expose its file, this one was made "
            f"before npuw_kv could record it, and {len(mapped)} safetensors files are mapped "
            f"({', '.join(map(str, mapped)) or 'none'}): import npuw_kv before making it, or "
            "use npuw_kv.Adapter(path)"
        )
    return mapped[0]
