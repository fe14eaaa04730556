"""The model: config (torch-free), tokenizer (torch-free), sampling (torch-free, numpy),
and the torch transformer, cache, generation, training and Hugging Face import.

Import the submodule you need; this package imports nothing heavy so that the server, which
has no torch, can use ``kvserve.model.config``, ``.tokenizer`` and ``.sampling``.
"""
