"""Models by name: `-m org/repo` and `-m org/repo-GGUF:Q4_K_M` through the Hugging Face cache.

``huggingface_hub`` (installed with ``tokenizers``) downloads into its own cache
(``$HF_HUB_CACHE``, default ~/.cache/huggingface/hub) with its progress bars,
resumes partial downloads, and honours ``HF_HUB_OFFLINE=1`` and ``HF_TOKEN``.
This module only decides which files a name means:

- ``org/repo`` of a Hugging Face checkpoint: the files cyllm reads (config,
  tokenizer, safetensors weights), as one snapshot directory;
- ``org/repo:QUANT`` (llama.cpp's ``-hf`` habit): the repo's one GGUF file whose
  name carries that quantization tag (``Q4_K_M``), or that exact file name;
- ``org/repo`` holding only GGUF files: Q4_K_M when there is one (llama.cpp's
  default), else the only GGUF file.

A local path always wins over a name: ``resolve_model`` is asked only for
names that are not an existing path.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

# what cyllm reads from a Hugging Face checkpoint; consolidated.safetensors (Mistral's
# second copy of the weights in another layout) is left out
HF_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "*.safetensors",
               "model.safetensors.index.json"]
HF_IGNORE = ["consolidated*", "*/*"]          # subfolders hold other formats (original/, onnx/...)
DEFAULT_QUANT = "Q4_K_M"

_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# quantization tags as llama.cpp names them in file names: Q4_K_M, Q8_0, IQ4_XS, F16, BF16...
_QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]{1,2}){0,2}|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


def parse_spec(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, quant or None)`` when ``spec`` has the shape of a hub name, else None."""
    repo, sep, quant = spec.partition(":")
    if not _REPO_RE.fullmatch(repo) or ".." in repo or repo.endswith((".", "-")):
        return None
    if sep and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,200}", quant):
        return None
    return repo, (quant or None)


def quant_tag(filename: str) -> str | None:
    """The quantization tag in a GGUF file name (``Q4_K_M``), or None."""
    tags = _QUANT_RE.findall(Path(filename).name)
    return tags[-1].upper() if tags else None


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401 -- a submodule the lazy package does not expose
    except ImportError:
        raise ModelLoadError("models by name need the huggingface_hub package "
                             "(pip install huggingface_hub), or pass a local path with -m") from None
    return huggingface_hub


def offline() -> bool:
    hub = _hub()
    return bool(getattr(hub.constants, "HF_HUB_OFFLINE", False))


def cache_dir() -> Path:
    return Path(_hub().constants.HF_HUB_CACHE)


def _describe_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _hub_error(e: Exception, repo: str, what: str) -> ModelLoadError:
    """One clear line for anything huggingface_hub (or the network under it) raises."""
    name = type(e).__name__
    names = {c.__name__ for c in type(e).__mro__}
    if "GatedRepoError" in names:
        return ModelLoadError(f"{repo} is a gated model: accept its license on https://huggingface.co/{repo} "
                              "and log in (`hf auth login` or HF_TOKEN)")
    if "RepositoryNotFoundError" in names:
        return ModelLoadError(f"model {repo} was not found on Hugging Face (a private repo needs "
                              "`hf auth login` or HF_TOKEN); a local path must exist")
    if "RevisionNotFoundError" in names:
        return ModelLoadError(f"{repo}: revision not found ({_describe_error(e)})")
    if "LocalEntryNotFoundError" in names or "OfflineModeIsEnabled" in names:
        if offline():
            return ModelLoadError(f"{repo} is not in the Hugging Face cache ({cache_dir()}) and downloads "
                                  "are off (HF_HUB_OFFLINE=1); run once online or pass a local path")
        return ModelLoadError(f"cannot download {what} of {repo}: Hugging Face is not reachable and the "
                              "files are not in the cache (no network?)")
    if "EntryNotFoundError" in names:
        return ModelLoadError(f"{repo} has no file {what}")
    if isinstance(e, OSError) and not any(n.endswith("HTTPError") for n in names):
        where = getattr(e, "filename", None) or cache_dir()
        return ModelLoadError(f"cannot write the download of {repo} to {where}: {e.strerror or e} "
                              "(set HF_HUB_CACHE to a writable directory)")
    module = type(e).__module__.split(".")[0]
    if module in ("httpx", "httpx2", "requests", "urllib3") or "HTTPError" in names or "Timeout" in name:
        return ModelLoadError(f"cannot download {what} of {repo} from Hugging Face ({_describe_error(e)}); "
                              "no network? HF_HUB_OFFLINE=1 uses the cache only")
    return ModelLoadError(f"cannot get {what} of {repo} from Hugging Face ({_describe_error(e)})")


def _cached_snapshot(repo: str) -> Path | None:
    """The cached snapshot directory of ``repo`` (revision main), or None."""
    hub = _hub()
    try:
        return Path(hub.snapshot_download(repo, local_files_only=True))
    except Exception:   # noqa: BLE001 -- anything means "not usable from the cache"
        return None


def _snapshot_files(snap: Path) -> list[str]:
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def _complete_checkpoint(snap: Path, files: list[str]) -> bool:
    """config.json and every weight file the index names (or one safetensors file) are cached."""
    if "config.json" not in files:
        return False
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        import json
        try:
            wmap = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            return bool(wmap) and all((snap / f).is_file() for f in set(wmap.values()))
        except (OSError, ValueError, AttributeError, TypeError, RecursionError):
            return False
    return any(f.endswith(".safetensors") for f in files)


def _from_cache(repo: str, quant: str | None, strict: bool) -> Path | None:
    """The model's local path when the cache already holds it, else None (no network used).

    strict (offline): a cached repo that lacks what ``quant`` names is an error here,
    since there is nowhere else to look.
    """
    snap = _cached_snapshot(repo)
    if snap is None:
        return None
    files = _snapshot_files(snap)
    try:
        gguf = pick_gguf(repo, files, quant)
    except ModelLoadError as e:
        if strict:
            raise ModelLoadError(f"{e} (in the cached copy; downloads are off: HF_HUB_OFFLINE=1)") from None
        return None
    if gguf is not None:
        return snap / gguf
    return snap if _complete_checkpoint(snap, files) else None


def _check_reachable() -> None:
    """Fail at once when the hub's host name does not even resolve (no network): huggingface_hub
    would retry for about 20 s before giving up."""
    import socket
    from urllib.parse import urlparse
    host = urlparse(getattr(_hub().constants, "ENDPOINT", "https://huggingface.co")).hostname
    if not host:
        return
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise ModelLoadError(f"cannot reach {host} ({e.strerror or e}): no network? "
                             "(HF_HUB_OFFLINE=1 uses the cache only)") from None


def _online_files(repo: str) -> list[str]:
    """The repo's file list from huggingface.co, its retry chatter kept off the terminal."""
    import logging
    hub = _hub()
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return list(hub.HfApi().list_repo_files(repo))
    except Exception as e:  # noqa: BLE001 -- mapped to one line
        raise _hub_error(e, repo, "the file list") from None
    finally:
        log.setLevel(level)


def pick_gguf(repo: str, files: list[str], quant: str | None) -> str | None:
    """The GGUF file ``quant`` names in ``files``; None when the repo has no GGUF at all."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in Path(f).name.lower()]
    if not ggufs:
        if quant:
            raise ModelLoadError(f"{repo} has no GGUF files, so {repo}:{quant} names nothing; "
                                 f"use -m {repo} for a Hugging Face checkpoint")
        return None
    if quant:
        exact = [f for f in ggufs if f == quant or Path(f).name == quant]
        matches = exact or [f for f in ggufs if quant_tag(f) == quant.upper()]
    else:
        matches = [f for f in ggufs if quant_tag(f) == DEFAULT_QUANT] or (ggufs if len(ggufs) == 1 else [])
    if not matches:
        tags = sorted({quant_tag(f) or Path(f).name for f in ggufs})
        if quant:
            raise ModelLoadError(f"{repo} has no GGUF file for {quant} (it has: {', '.join(tags)})")
        raise ModelLoadError(f"{repo} holds several GGUF files: choose one with {repo}:QUANT "
                             f"(one of {', '.join(tags)})")
    whole = [f for f in matches if not _SPLIT_RE.search(f)]
    if not whole:
        raise ModelLoadError(f"{repo}: {matches[0]} is split into several files, which cyllm cannot "
                             "load; merge them with llama.cpp's gguf-split --merge")
    if len(whole) > 1:
        raise ModelLoadError(f"{repo}: several GGUF files match {quant or DEFAULT_QUANT} "
                             f"({', '.join(whole[:4])}); name one exactly, as {repo}:FILE.gguf")
    return whole[0]


def resolve_model(spec: str) -> Path:
    """The local path (GGUF file or checkpoint directory) of hub name ``spec``, downloading it if needed.

    A model already in the cache is used as it is, without asking the network.
    """
    parsed = parse_spec(spec)
    if parsed is None:
        raise ModelLoadError(f"model path not found: {spec}")
    repo, quant = parsed
    cached = _from_cache(repo, quant, strict=offline())
    if cached is not None:
        return cached
    if offline():
        raise ModelLoadError(f"{repo} is not in the Hugging Face cache ({cache_dir()}) and downloads "
                             "are off (HF_HUB_OFFLINE=1); run once online or pass a local path")
    hub = _hub()
    _check_reachable()
    print(f"cyllm: looking up {repo} on Hugging Face ...", file=sys.stderr, flush=True)
    files = _online_files(repo)
    gguf = pick_gguf(repo, files, quant)
    if gguf is not None:
        try:
            return Path(hub.hf_hub_download(repo, gguf))
        except Exception as e:  # noqa: BLE001
            raise _hub_error(e, repo, gguf) from None
    if "config.json" not in files:
        raise ModelLoadError(f"{repo} holds neither GGUF files nor a Hugging Face checkpoint "
                             "(config.json + safetensors)")
    if not any(f.endswith(".safetensors") and "/" not in f for f in files):
        raise ModelLoadError(f"{repo} has no safetensors weights (cyllm does not read .bin/.pt files)")
    try:
        return Path(hub.snapshot_download(repo, allow_patterns=HF_PATTERNS, ignore_patterns=HF_IGNORE))
    except Exception as e:  # noqa: BLE001
        raise _hub_error(e, repo, "the weights") from None


# -- `cyllm models` ---------------------------------------------------------------------
@dataclass
class CachedModel:
    name: str          # what -m takes
    kind: str          # "gguf" | "safetensors"
    size: int          # bytes on disk
    path: Path


def cached_models() -> list[CachedModel]:
    """Every model in the Hugging Face cache that cyllm can load (by -m name)."""
    hub = _hub()
    try:
        info = hub.scan_cache_dir()
    except Exception:   # noqa: BLE001 -- no cache yet (CacheNotFound) or unreadable
        return []
    out: list[CachedModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        if not revs:
            continue
        rev = next((r for r in revs if "main" in r.refs), revs[0])
        files = {f.file_name: f for f in rev.files}
        ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
        for g in ggufs:
            tag = quant_tag(g)
            others = [x for x in ggufs if quant_tag(x) == tag]
            name = f"{repo.repo_id}:{tag}" if tag and len(others) == 1 else f"{repo.repo_id}:{g}"
            out.append(CachedModel(name, "gguf", files[g].size_on_disk, Path(files[g].file_path)))
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            size = sum(f.size_on_disk for f in files.values())
            out.append(CachedModel(repo.repo_id, "safetensors", size, Path(rev.snapshot_path)))
    return out


__all__ = ["resolve_model", "parse_spec", "cached_models", "quant_tag", "pick_gguf", "offline", "cache_dir"]


def model_path(spec: str | None):
    """A local path for ``-m``: an existing path as given, else a Hugging Face name resolved
    through its cache (downloading when needed); None for the default model."""
    if spec is None:
        return None
    local = os.path.expanduser(spec)
    try:
        os.stat(local)
        return local
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:         # a component too long, a loop of links, no permission...
        raise ModelLoadError(f"cannot use model path {spec}: {e.strerror or e}") from None
    if parse_spec(spec) is None or (spec.lower().endswith((".gguf", ".json", ".safetensors")) and ":" not in spec):
        return local                  # the loader says "not found"
    try:
        return str(resolve_model(spec))
    except ModelLoadError as e:
        raise ModelLoadError(f"{spec} is not a local path, and as a Hugging Face name: {e}") from None
