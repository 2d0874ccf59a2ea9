"""Memory a model's run state needs, against memory this process can still get.

A context length, a layer count or a prompt size comes from a flag or a file;
``-c 100000000`` or a config with ten million layers would otherwise allocate
(or try to) terabytes before anything else fails. :func:`check_model_fits`
runs before the Model allocates its KV cache, rope tables and scratch buffers
and refuses, in one line, what cannot fit.

"Available" is the tightest of: MemAvailable (/proc/meminfo), the cgroup's
memory limit minus its usage (containers), and the address-space limit
(RLIMIT_AS) minus this process's current size; for the CUDA backend, the
device's free memory. Where none is known the check passes.
"""

from __future__ import annotations

import mmap
import resource

import numpy as np

from .errors import InvalidArgumentError, ModelLoadError


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text in ("", "max") else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_headroom() -> int | None:
    """Bytes left under the cgroup memory limit (v2, else v1); None without a limit."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_path)
        if limit is not None and limit < 1 << 60:     # v1 writes "no limit" as a huge number
            usage = _read_int(usage_path) or 0
            return max(limit - usage, 0)
    return None


def _address_space_headroom() -> int | None:
    """Bytes left under RLIMIT_AS (ulimit -v); None when unlimited."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    size = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    size = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - (size or 0), 0)


def host_available() -> int | None:
    """Bytes of host memory this process can still allocate (None where unknown)."""
    known = [v for v in (_meminfo("MemAvailable"), _cgroup_headroom(), _address_space_headroom())
             if v is not None]
    return min(known) if known else None


def device_available(backend) -> int | None:
    """Free device memory of a CUDA backend (None for host backends or when unknown)."""
    if getattr(backend, "name", None) != "cuda":
        return None
    try:
        import cupy
        free, _ = cupy.cuda.runtime.memGetInfo()
        return int(free) + int(cupy.get_default_memory_pool().free_bytes())
    except Exception:  # noqa: BLE001 - no driver details: skip the check rather than guess
        return None


def state_bytes(config, context: int, prefill_rows: int = 256) -> tuple[int, int]:
    """(bytes per context position, fixed bytes) of a model's run state.

    Per position: the f16 K and V cache of every layer, the f32 cos and sin of
    each distinct rope table (with the temporaries that build them), attention
    scratch. Fixed: the decode and prefill buffers.
    """
    c = config
    ropes = {repr(c.layer_rope(i)) for i in range(c.n_layers)} - {"None"}
    rot = c.rotary_dim or c.head_dim
    per_pos = c.kv_bytes_per_token()
    per_pos += len(ropes) * 3 * rot * 4           # cos + sin (rot/2 each) and their temporaries
    per_pos += 4 * (c.n_heads + 64)               # attention scores scratch
    rows = min(prefill_rows, context)
    width = 3 * c.dim + c.q_dim + 2 * c.kv_dim + c.q_dim + c.ffn_dim
    if c.moe:       # backends.moe.MoeScratch: scores, logits, h and y of a row, a row gathered, the
        width += 2 * c.n_experts + c.ffn_dim + 2 * c.dim + c.n_experts_used * c.dim    # ranks' outputs
    fixed = 4 * (rows + 1) * width + 4 * c.vocab_size * 2
    return per_pos, fixed


def upload_bytes(backend, weights: dict) -> int:
    """Bytes that uploading ``weights`` to ``backend`` allocates anew (numpy: f32 copies of
    the f16 matrices; cuda: all of them on the device; cpu: none, views stay mapped)."""
    name = getattr(backend, "name", None)
    if name == "numpy":
        return sum(int(a.nbytes) * (2 if getattr(a, "dtype", None) == np.float16 else 1)
                   for a in weights.values() if hasattr(a, "nbytes"))
    if name == "cuda":
        return sum(int(a.nbytes) for a in weights.values() if hasattr(a, "nbytes"))
    return 0


def fmt_bytes(n: float) -> str:
    if n < 1e3:
        return f"{int(n)} B"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.0f} kB"


def check_model_fits(backend, config, context: int, weights: dict, explicit: bool) -> None:
    """Refuse a model whose run state cannot be allocated: InvalidArgumentError when the caller
    chose ``context`` (``explicit``), ModelLoadError when the model's own sizes are the cause."""
    per_pos, fixed = state_bytes(config, context)
    fixed += upload_bytes(backend, weights)
    device = getattr(backend, "name", None) == "cuda"
    avail = device_available(backend) if device else host_available()
    if avail is None:
        return
    need = per_pos * context + fixed
    if need <= avail:
        return
    where = "GPU memory" if device else "memory"
    fits = max((avail - fixed) // per_pos, 0)
    if explicit:
        raise InvalidArgumentError(
            f"a context of {context} tokens needs {fmt_bytes(need)} ({fmt_bytes(per_pos)} per token for the "
            f"KV cache and rope tables) but only {fmt_bytes(avail)} of {where} is available; "
            + (f"at most about {fits} tokens fit: choose a smaller context" if fits else
               "not even a short context fits"))
    raise ModelLoadError(
        f"this model's run state for {context} tokens needs {fmt_bytes(need)} but only {fmt_bytes(avail)} of "
        f"{where} is available" + (f"; choose a smaller context (at most about {fits} tokens fit)" if fits else ""))


def drop_mapped_pages(buf, offset: int, nbytes: int) -> None:
    """Drop bytes [offset, offset + nbytes) of the read-only file mapping ``buf`` (an mmap)
    from this process's resident set, from the page that holds ``offset`` on.

    For data that has been converted or copied and is not read again; a later read faults
    the pages back in from the file, so a neighbour that shares the first page is safe.
    Only advice: where the platform has no MADV_DONTNEED nothing happens."""
    advise = getattr(buf, "madvise", None)
    if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    try:
        advise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
    except (OSError, ValueError):
        pass


def drop_array_file_pages(a: np.ndarray) -> None:
    """drop_mapped_pages for ``a`` when it is a view of a read-only file mapping (a GGUF
    tensor reordered at load is not read again); anonymous or writable memory is left alone
    (dropping it would lose its contents)."""
    base = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    if base is None or base.closed:
        return
    start_of_map = np.frombuffer(base, np.uint8, count=1)
    if start_of_map.flags.writeable:
        return
    off = a.ctypes.data - start_of_map.ctypes.data
    if 0 <= off and off + a.nbytes <= len(base):
        drop_mapped_pages(base, off, a.nbytes)


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). Loading frees
    its temporaries (the parsed metadata, the tokenizer's build, the slices of weights being
    reordered) into the heap, where their pages stay resident: 41 MB after loading the
    SmolLM2-360M-shape Q8_0 file of tests/test_memory_quant.py. Without glibc, nothing."""
    import ctypes
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
