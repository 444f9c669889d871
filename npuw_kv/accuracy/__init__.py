"""Accuracy checks: our pipeline vs exact f32 references on long real-text prompts.

``metrics`` (pure numpy), ``reference`` (what we compare against), ``run`` (the matrix of
configurations), ``report`` (table, JSON, Markdown, plot).
"""
