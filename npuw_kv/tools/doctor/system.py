"""The machine as an NPU issue needs it: versions, the CPU, the devices OpenVINO lists, and
whether the NPU's driver and compiler are there.

The NPU plugin in the PyPI wheel compiles only through a compiler library it loads at run time
(``libopenvino_intel_npu_compiler_loader.so``, next to the plugin), which the wheel does not
ship; without it every NPU compile fails with "Cannot load library".  So the report names the
library, where it looked, and where it comes from.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from ... import __version__
from ...errors import last_line
from ...runtime.npu_compile import COMPILER_SOURCES
from .context import DoctorContext, error_text, md_table

NPU_PROPERTIES = (
    "FULL_DEVICE_NAME",
    "DEVICE_ARCHITECTURE",
    "NPU_DRIVER_VERSION",
    "NPU_COMPILER_VERSION",
    "NPU_COMPILER_TYPE",
)
PLUGIN, LOADER = "openvino_intel_npu_plugin", "openvino_intel_npu_compiler_loader"
PACKAGES = ("openvino", "openvino-genai", "openvino-tokenizers")


def library_name(base: str) -> str:
    """The file name of the shared library ``base`` on this system."""
    return f"{base}.dll" if sys.platform == "win32" else f"lib{base}.so"


def openvino_libs() -> Path:
    """Where the wheel keeps its plugins: ``<openvino package>/libs``."""
    import openvino as ov

    return Path(ov.__file__).parent / "libs"


def cpu_model() -> str:
    """/proc/cpuinfo's "model name" (Linux), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def system(ctx: DoctorContext) -> list[str]:
    """Versions, Python, OS, CPU and the devices OpenVINO lists; the model it will run."""
    import openvino as ov

    rows = [("npuw-kv", __version__)]
    rows += [(name, _version(name)) for name in PACKAGES]
    rows += [
        ("OpenVINO runtime build", ov.get_version()),
        ("Python", sys.version.split()[0]),
        ("OS", platform.platform()),
        ("CPU", f"{cpu_model()} ({os.cpu_count()} logical cores)"),
        ("ov.Core().available_devices", ", ".join(ov.Core().available_devices) or "none"),
    ]
    table = md_table(("what", "value"), ((what, f"`{value}`") for what, value in rows))
    return [*table, "", f"Model: {_model(ctx)}"]


def _model(ctx: DoctorContext) -> str:
    """The model as given and where its IR is; an error here fails the model sections later,
    not this one."""
    given = ctx.options.model or "smollm2 (the default)"
    try:
        return f"{given}, IR in `{ctx.model_dir()}`"
    except Exception as exc:
        return f"{given}: **cannot be loaded**: {error_text(exc)}"


def read_property(name: str) -> str:
    """``core.get_property("NPU", name)``, or the error's last line: both say something."""
    import openvino as ov

    try:
        return f"`{ov.Core().get_property('NPU', name)}`"
    except Exception as exc:
        return f"error: {last_line(exc)}"


def npu_driver(ctx: DoctorContext) -> list[str]:
    """Whether there is an NPU, what its plugin says, and whether its compiler can load."""
    import openvino as ov

    from ...runtime.npu_strides import strides_supported

    libs = openvino_libs()
    plugin, loader = libs / library_name(PLUGIN), libs / library_name(LOADER)
    lines = [
        "NPU in `available_devices`: "
        + ("yes" if ctx.npu else "**no NPU here**: the NPU path runs on NPUW's CPU stand-in"),
        "",
        *md_table(
            ("NPU property", "value or error"), ((n, read_property(n)) for n in NPU_PROPERTIES)
        ),
        "",
        "`NPU_ENABLE_STRIDES_FOR` listed (npuw-kv then binds the strided KV views in place): "
        + ("yes" if strides_supported(ov.Core()) else "no"),
        "",
        *md_table(
            ("file", "present"),
            (
                (f"`{plugin}` (the NPU plugin)", "yes" if plugin.exists() else "**no**"),
                (f"`{loader}` (the compiler loader)", "yes" if loader.exists() else "**no**"),
                ("Level Zero loader (`ze_loader`)", ctypes.util.find_library("ze_loader") or "no"),
                ("NPU device nodes (`/dev/accel/*`)", _accel_nodes()),
            ),
        ),
        "",
    ]
    where = f"`{library_name(LOADER)}` must sit next to the NPU plugin, in `{libs}`: "
    where += f"{COMPILER_SOURCES}."
    if loader.exists():
        lines.append(f"The compiler loader is there. ({where})")
    else:
        lines.append(f"**The compiler loader is missing**, so nothing compiles for an NPU: {where}")
    return lines


def _accel_nodes() -> str:
    accel = Path("/dev/accel")
    nodes = sorted(p.name for p in accel.iterdir()) if accel.is_dir() else []
    return ", ".join(nodes) or "none"
