"""convert: GGUF -> Hugging Face directory that transformers loads, with matching logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cyllm.tools.convert import convert_gguf_to_hf
from cyllm.errors import InvalidArgumentError, ModelLoadError
from conftest import HOST_BACKENDS


def pick_backend() -> str:
    return HOST_BACKENDS[-1]      # the compiled cpu backend when built, else the numpy reference


@pytest.fixture(scope="module")
def real_path():
    from cyllm.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def converted(real_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "smol-hf"
    assert convert_gguf_to_hf(real_path, out) == out
    return out


def test_files_and_config(converted):
    names = sorted(p.name for p in converted.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float16"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]) == (576, 30, 9, 3, 1536, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    tc = json.loads((converted / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "chat_template" in tc
    from safetensors import safe_open
    with safe_open(str(converted / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and len(keys) == 2 + 30 * 9
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == np.float16


def test_transformers_loads_and_logits_match(real_path, converted, monkeypatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cyllm

    # convert writes the dequantized values: compare transformers with cyllm computing on
    # those same values in float (the native path rounds activations to int8 blocks)
    monkeypatch.setenv("CYLLM_QUANT", "f16")
    ours = cyllm.load(real_path, backend=pick_backend())
    ids = ours.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    mine = ours.logits(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(mine - ref).max() / np.abs(ref).max()
    assert rel < 1e-2, rel
    tok = transformers.AutoTokenizer.from_pretrained(str(converted))
    for s in ["Hello world", "  spaces\n\nand 12345 digits", "héllo 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(s) == ours.tokenizer.encode(s), s
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ours.tokenizer.apply_chat_template(msgs)
    # and our own loader reads the directory back to the same logits
    back = cyllm.load(converted, backend=pick_backend())
    rel2 = np.abs(back.logits(ids) - mine).max() / np.abs(mine).max()
    assert rel2 < 1e-2, rel2


def test_refuses_non_empty_out_dir(real_path, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(InvalidArgumentError) as e:
        convert_gguf_to_hf(real_path, out)
    assert "not empty" in str(e.value) and "\n" not in str(e.value)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InvalidArgumentError):
        convert_gguf_to_hf(real_path, f)


def test_overwrite(real_path, converted, tmp_path):
    import shutil
    out = tmp_path / "again"
    shutil.copytree(converted, out)
    convert_gguf_to_hf(real_path, out, overwrite=True)
    assert (out / "model.safetensors").stat().st_size == (converted / "model.safetensors").stat().st_size


def test_bad_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError):
        convert_gguf_to_hf(bad, tmp_path / "o")
    assert not (tmp_path / "o").exists()
