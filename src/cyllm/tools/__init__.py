"""The tools built on the engine: the command line (cli, repl), the server, and the
commands that measure or rewrite models (bench, tune, perplexity, convert, quantize,
info, synthetic weights).

The engine (cyllm.load, config, loading/, model, backends/, generate, sampling,
tokenizer, quant/) never imports from here; tests/test_layering.py checks it.
"""
