"""cyllm: fast single-batch LLM inference on your own machine, from Python.

    import cyllm
    model = cyllm.load("path/to/model-or.gguf")      # no path: the default model
    for piece in model.generate("Hello", max_tokens=32):
        print(piece, end="")
"""

from __future__ import annotations

from .errors import CyllmError

__version__ = "0.1.0"
__all__ = ["load", "Model", "Chat", "CyllmError", "__version__"]


def load(path=None, backend: str = "cpu", threads=None, context=None, threads_batch=None,
         quantize: str | None = None):
    """Load a Hugging Face model directory, a GGUF file or a Hugging Face model name
    ("org/repo", "org/repo-GGUF:Q4_K_M"; None: the default model).

    backend: "cpu" (default), "cuda" or "numpy" (the slow float32 reference).
    threads: kernel threads (default: OMP_NUM_THREADS, saved tuning, or physical cores).
    threads_batch: threads for prompt processing, when it should differ from ``threads``.
    context: KV-cache positions (default: the model's context length, at most 4096).
    quantize: "q8_0" | "q4_0" | "q4_k": quantize the float matrices in memory at load
    (llama.cpp's recipes: q4_k is Q4_K_M's); quantized GGUF tensors stay as stored.
    """
    from .backends import get_backend
    from .loading import load_path
    from .model import Model

    if quantize is not None:
        from .quant.convert import check_quantize_type
        quantize = check_quantize_type(quantize)
    be = get_backend(backend, threads)       # fail fast on a bad backend or thread count
    if path is None:
        from .default_model import default_model_path
        path = default_model_path()
    else:
        import os
        if not isinstance(path, (str, os.PathLike)):
            from .errors import InvalidArgumentError
            raise InvalidArgumentError(f"the model path must be a string or a path, got {type(path).__name__}")
        from .hub import model_path           # a Hugging Face name ("org/repo[:QUANT]") works too
        path = model_path(os.fspath(path))
    config, weights, tokenizer = load_path(path)
    if quantize is not None:
        from .quant.convert import quantize_weights
        quantize_weights(config, weights, quantize, be.threads if be.name == "cpu" else None)
    model = Model(config, weights, tokenizer, backend=be, context=context, consume_weights=True)
    del weights
    _apply_thread_policy(model, threads, threads_batch)
    from .memory import release_freed_heap
    release_freed_heap()                    # the load's freed temporaries off the resident set
    return model


def _apply_thread_policy(model, threads, threads_batch) -> None:
    """Flags win, then OMP_NUM_THREADS, then a saved `cyllm tune` result for this size class."""
    import os

    decode = model.threads_decode
    prefill = threads_batch
    if threads is None and not os.environ.get("OMP_NUM_THREADS", "").strip():
        from .saved_tuning import tuned_threads
        tuned_decode, tuned_prefill = tuned_threads(model.weight_bytes)
        decode = tuned_decode or decode
        prefill = prefill if prefill is not None else tuned_prefill
    model.set_threads(decode, prefill)


def __getattr__(name):
    if name == "Model":
        from .model import Model
        return Model
    if name == "Chat":
        from .generate import Chat
        return Chat
    raise AttributeError(name)
