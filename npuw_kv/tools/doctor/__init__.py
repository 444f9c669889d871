"""``npuw-kv doctor``: what an Intel NPU owner attaches to an issue, gathered into one report.

``context`` (the options and what the sections share), ``report`` (running a section, the
Markdown), ``system`` (the machine, the NPU driver and compiler), ``npu_path`` (compiling the
NPU path, its copies per step), ``compare`` (accuracy and speed beside the CPU path and NPUW's
own pipeline), ``run`` (the sections in order, the exit code).
"""
