"""Kept for existing imports: gin bindings onto the run config now live in rljax/config/gin_bindings.py
(`rljax.config.apply_gin`)."""
from rljax.config.gin_bindings import apply_gin, schema

__all__ = ["apply_gin", "schema"]
