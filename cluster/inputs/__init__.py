"""Inputs read and checked once, before Ray starts: the spec file, data files, models, tokenizers."""
