"""Accuracy checks: our pipeline vs exact f32 references on long real-text prompts.

``metrics`` (pure numpy), ``reference`` (what we compare against), ``modes`` (our
configurations and their tolerances), ``peers`` (other runtimes scored against the same
reference), ``result`` (a row), ``run`` (the matrix of configurations), ``report`` (table,
JSON, Markdown, plot).
"""
