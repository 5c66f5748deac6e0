"""One module per tuning domain; each exposes ``plan(section, ctx)``."""
