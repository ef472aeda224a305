"""Tiny things built on the fly (a model and its tokenizer, later a synthetic task) so CPU runs and
tests need no downloads."""
