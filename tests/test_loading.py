"""Safetensors reader and Hugging Face directory loader."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import types

import numpy as np
import pytest

from cyllm.errors import CyllmError, ModelLoadError, TokenizerError, UnsupportedModelError
from cyllm.loading import expected_shapes, load_path, validate_weights
from cyllm.loading.hf import load_hf_dir
from cyllm.loading.safetensors import SafetensorsFile, load_safetensors

from tinymodels import make_tiny_model

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file as torch_load_file, save_file as torch_save_file  # noqa: E402


# ------------------------------------------------------------------ helpers
def write_raw(path, header, data: bytes = b"", header_bytes: bytes | None = None):
    """A safetensors-like file with an arbitrary (possibly broken) header."""
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    return path


def expect(exc_type, fn, *args, match: str):
    with pytest.raises(exc_type, match=match) as ei:
        fn(*args)
    assert isinstance(ei.value, CyllmError)
    return ei.value


@pytest.fixture(scope="module")
def tensors_file(tmp_path_factory):
    """One file with every dtype we read, odd shapes and unaligned offsets."""
    g = torch.Generator().manual_seed(0)
    t = {
        "f16": torch.randn(7, 13, generator=g).half(),
        "f16_odd": torch.randn(3, generator=g).half(),          # 6 bytes: misaligns the next
        "f32": torch.randn(5, 11, generator=g),
        "bf16": (torch.randn(9, 6, generator=g) * 100).bfloat16(),
        "f32_3d": torch.randn(2, 3, 4, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    torch_save_file(t, str(path))
    return path, t


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {
        "f32": make_tiny_model(base, "llama_mqa_odd", dtype="float32"),
        "f16": make_tiny_model(base, "llama_mqa_odd", dtype="float16"),
        "bf16": make_tiny_model(base, "llama_mqa_odd", dtype="bfloat16"),
        "bf16_sharded": make_tiny_model(base, "llama_mqa_odd", dtype="bfloat16", sharded=True),
        "qwen": make_tiny_model(base, "qwen2_bias", dtype="float32", sharded=True),
        "tied": make_tiny_model(base, "llama_tied", dtype="float16"),
    }


@pytest.fixture
def model_copy(tiny_dirs, tmp_path):
    def copy(key="f32"):
        dst = tmp_path / key
        shutil.copytree(tiny_dirs[key], dst)
        return dst
    return copy


# ------------------------------------------------------------ reader parity
def test_reader_matches_safetensors_package(tensors_file):
    path, t = tensors_file
    ours = load_safetensors(path)
    assert set(ours) == set(t)
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            ref = f.get_tensor(name)
            if ref.dtype == torch.bfloat16:
                want = ref.float().numpy()
                assert ours[name].dtype == np.float32
            else:
                want = ref.numpy()
                assert ours[name].dtype == want.dtype
            assert ours[name].shape == want.shape, name
            np.testing.assert_array_equal(ours[name], want, err_msg=name)


def test_reader_matches_safe_open_numpy(tensors_file):
    path, _ = tensors_file
    ours = load_safetensors(path)
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            if name == "bf16":
                continue  # numpy has no bfloat16 (covered by the torch comparison)
            np.testing.assert_array_equal(ours[name], f.get_tensor(name), err_msg=name)


def test_bf16_matches_ml_dtypes(tensors_file):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    path, _ = tensors_file
    f = SafetensorsFile(path)
    tag, bits = f.raw("bf16")
    assert tag == "BF16" and bits.dtype == np.uint16
    want = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(f.get("bf16"), want)


def test_f16_is_zero_copy_and_read_only(tensors_file):
    path, _ = tensors_file
    f = SafetensorsFile(path)
    for name in ("f16", "f16_odd", "f32"):
        a = f.get(name)
        assert not a.flags.owndata
        assert not a.flags.writeable
        assert np.shares_memory(a, np.frombuffer(f._mm, dtype=np.uint8))
        with pytest.raises(ValueError):
            a[...] = 0


def test_views_outlive_the_file_object(tensors_file):
    path, t = tensors_file
    a = SafetensorsFile(path).get("f32")   # the SafetensorsFile is garbage now
    import gc
    gc.collect()
    np.testing.assert_array_equal(a, t["f32"].numpy())


# ------------------------------------------------------------- bad files
def test_truncated_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    expect(ModelLoadError, SafetensorsFile, p, match="shorter than the 8-byte")


def test_header_longer_than_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    e = expect(ModelLoadError, SafetensorsFile, p, match="header length 10000 is larger than the file")
    assert str(p) in str(e)


def test_garbage_header(tmp_path):
    p = write_raw(tmp_path / "x.safetensors", None, header_bytes=b"not json at all")
    expect(ModelLoadError, SafetensorsFile, p, match="not valid JSON")
    p = write_raw(tmp_path / "y.safetensors", None, header_bytes=b"\xff\xfe\x00")
    expect(ModelLoadError, SafetensorsFile, p, match="not valid JSON")
    p = write_raw(tmp_path / "z.safetensors", [1, 2, 3])
    expect(ModelLoadError, SafetensorsFile, p, match="not a JSON object")


@pytest.mark.parametrize("entry, msg", [
    ({"shape": [2], "data_offsets": [0, 8]}, "no 'dtype'"),
    ({"dtype": "F32", "data_offsets": [0, 8]}, "no 'shape'"),
    ({"dtype": "F32", "shape": [2]}, "no 'data_offsets'"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}, "run past the end of the file"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "end 0 < start 8"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 8]}, "holds 8 bytes, but shape"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "bad shape"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, "bad data_offsets"),
    ("nope", "not an object"),
])
def test_bad_entries(tmp_path, entry, msg):
    p = write_raw(tmp_path / "x.safetensors", {"w": entry}, b"\0" * 16)
    e = expect(ModelLoadError, SafetensorsFile, p, match=msg)
    assert "'w'" in str(e) and str(p) in str(e)


def test_unknown_dtype(tmp_path):
    p = write_raw(tmp_path / "x.safetensors",
                  {"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2)
    expect(UnsupportedModelError, SafetensorsFile, p, match="unsupported dtype 'F8_E4M3'")


def test_metadata_is_not_a_tensor(tmp_path):
    hdr = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    p = write_raw(tmp_path / "x.safetensors", hdr, np.array([1, 2], np.float32).tobytes())
    f = SafetensorsFile(p)
    assert f.keys() == ["w"]
    np.testing.assert_array_equal(f.get("w"), [1, 2])


# -------------------------------------------------------- HF directories
def _reference_state(model_dir):
    """The checkpoint's tensors via the safetensors package, as float32 torch."""
    out = {}
    for p in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.float() for k, v in torch_load_file(str(p)).items()})
    return out


@pytest.mark.parametrize("key", ["f32", "f16", "bf16", "bf16_sharded", "qwen", "tied"])
def test_hf_dir_matches_checkpoint(tiny_dirs, key):
    d = tiny_dirs[key]
    config, weights, tok = load_hf_dir(d)
    validate_weights(config, weights)
    ref = _reference_state(d)
    assert set(expected_shapes(config)) <= set(weights)
    for name, arr in weights.items():
        want = ref[name]
        if arr.ndim == 2:
            assert arr.dtype == np.float16, name
            np.testing.assert_array_equal(arr, want.half().numpy(), err_msg=name)
        else:
            assert arr.dtype == np.float32, name
            np.testing.assert_array_equal(arr, want.numpy(), err_msg=name)
    assert tok is not None and tok.vocab_size == config.vocab_size
    assert config.eos_token_ids == [2] and config.bos_token_id == 1


def test_f16_checkpoint_is_zero_copy(tiny_dirs):
    _, weights, _ = load_hf_dir(tiny_dirs["f16"])
    w = weights["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == np.float16 and not w.flags.owndata and not w.flags.writeable


def test_sharded_equals_single(tiny_dirs):
    _, a, _ = load_hf_dir(tiny_dirs["bf16"])
    _, b, _ = load_hf_dir(tiny_dirs["bf16_sharded"])
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_config_fields(tiny_dirs):
    c, w, _ = load_hf_dir(tiny_dirs["qwen"])
    assert c.arch == "qwen2" and c.attention_bias
    assert np.abs(w["model.layers.0.self_attn.q_proj.bias"]).max() > 0.01   # non-zero biases
    c, w, _ = load_hf_dir(tiny_dirs["tied"])
    assert c.tie_word_embeddings and "lm_head.weight" not in w
    c, _, _ = load_hf_dir(tiny_dirs["f32"])
    assert (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (72, 3, 1, 24, 100)
    assert c.name == tiny_dirs["f32"].name


def test_load_path_dispatch(tiny_dirs, tmp_path, monkeypatch):
    c, w, t = load_path(tiny_dirs["f32"])
    assert c.arch == "llama" and t is not None
    expect(ModelLoadError, load_path, tmp_path / "nope", match="model path not found")
    other = tmp_path / "weights.txt"
    other.write_text("hello")
    expect(ModelLoadError, load_path, other, match="neither a model directory")
    st = tmp_path / "model.safetensors"
    st.write_bytes(b"\0" * 16)
    expect(ModelLoadError, load_path, st, match="pass the model directory")

    # GGUF by extension and by magic go to loading.gguf.load_gguf (faked here)
    calls = []
    fake = types.ModuleType("cyllm.loading.gguf")
    fake.load_gguf = lambda p: calls.append(p) or ("cfg", {}, None)
    monkeypatch.setitem(sys.modules, "cyllm.loading.gguf", fake)
    g1 = tmp_path / "m.gguf"
    g1.write_bytes(b"GGUF\3\0\0\0")
    g2 = tmp_path / "model.bin"
    g2.write_bytes(b"GGUF\3\0\0\0")
    assert load_path(g1)[0] == "cfg" and load_path(g2)[0] == "cfg"
    assert calls == [g1, g2]


def test_no_config_json(tmp_path):
    expect(ModelLoadError, load_path, tmp_path, match="no config.json in")


def test_bad_config_json(model_copy):
    d = model_copy()
    (d / "config.json").write_text("{not json")
    expect(ModelLoadError, load_hf_dir, d, match="config.json is not valid JSON")


def test_unsupported_architecture(model_copy):
    d = model_copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    expect(UnsupportedModelError, load_hf_dir, d, match="'GPT2LMHeadModel' is not supported")


def test_missing_config_key(model_copy):
    d = model_copy()
    cfg = json.loads((d / "config.json").read_text())
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    expect(ModelLoadError, load_hf_dir, d, match="missing required key 'intermediate_size'")


def test_no_weights(model_copy):
    d = model_copy()
    (d / "model.safetensors").unlink()
    expect(ModelLoadError, load_hf_dir, d, match="pytorch_model.bin is not supported")
    (d / "pytorch_model.bin").write_bytes(b"x")
    expect(ModelLoadError, load_hf_dir, d, match="convert them to safetensors")


def _rewrite(d, fn):
    """Load model.safetensors, let fn edit the dict, write it back."""
    t = torch_load_file(str(d / "model.safetensors"))
    fn(t)
    torch_save_file(t, str(d / "model.safetensors"))


def test_missing_tensor(model_copy):
    d = model_copy()
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect(ModelLoadError, load_hf_dir, d, match="missing tensor model.layers.1.mlp.up_proj.weight")


def test_missing_lm_head_when_untied(model_copy):
    d = model_copy()
    _rewrite(d, lambda t: t.pop("lm_head.weight"))
    expect(ModelLoadError, load_hf_dir, d, match="missing tensor lm_head.weight")


def test_wrong_shape(model_copy):
    d = model_copy()
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(48, 72)))
    expect(ModelLoadError, load_hf_dir, d,
           match=r"tensor model.layers.0.self_attn.k_proj.weight has shape \(48, 72\), expected \(24, 72\)")


def test_extra_tensors_are_dropped(model_copy):
    d = model_copy()
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(12)))
    _, w, _ = load_hf_dir(d)
    assert not any("inv_freq" in k for k in w)


def test_tied_checkpoint_may_keep_lm_head(model_copy):
    d = model_copy("tied")
    _rewrite(d, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    _, w, _ = load_hf_dir(d)
    assert w["lm_head.weight"].shape == w["model.embed_tokens.weight"].shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_f16_overflow(model_copy, dtype):
    d = model_copy()

    def poison(t):
        w = t["model.layers.1.mlp.down_proj.weight"].to(dtype)
        w[3, 5] = 1e5
        t["model.layers.1.mlp.down_proj.weight"] = w
    _rewrite(d, poison)
    expect(ModelLoadError, load_hf_dir, d,
           match=r"tensor model.layers.1.mlp.down_proj.weight .*beyond the float16 range")


def test_unsupported_tensor_dtype(model_copy):
    d = model_copy()
    _rewrite(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(72, dtype=torch.int32)))
    expect(UnsupportedModelError, load_hf_dir, d, match="model.norm.weight .* has dtype I32")


def test_sharded_missing_shard(model_copy):
    d = model_copy("bf16_sharded")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    expect(ModelLoadError, load_hf_dir, d, match=f"shard {shards[-1].name} .* is missing")


def test_sharded_bad_index(model_copy):
    d = model_copy("bf16_sharded")
    (d / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    expect(ModelLoadError, load_hf_dir, d, match="weight_map")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    expect(ModelLoadError, load_hf_dir, d, match="bad shard file name")


def test_truncated_weights_file(model_copy):
    d = model_copy()
    p = d / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])
    expect(ModelLoadError, load_hf_dir, d, match="may be truncated")


def test_generation_config_eos_merged(model_copy):
    d = model_copy()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 7], "bos_token_id": 1}))
    c, _, tok = load_hf_dir(d)
    assert c.eos_token_ids == [2, 5, 7]
    assert tok.eos_ids == {2, 5, 7}
    (d / "generation_config.json").write_text("{oops")
    expect(ModelLoadError, load_hf_dir, d, match="generation_config.json is not valid JSON")


def test_missing_and_bad_tokenizer(model_copy):
    d = model_copy()
    (d / "tokenizer.json").write_text("{garbage")
    expect(TokenizerError, load_hf_dir, d, match="cannot load tokenizer")
    (d / "tokenizer.json").unlink()
    c, w, tok = load_hf_dir(d)
    assert tok is None and w


def test_validate_weights_checks_dtype_and_presence(tiny_dirs):
    c, w, _ = load_hf_dir(tiny_dirs["f32"])
    bad = dict(w)
    bad["model.norm.weight"] = w["model.norm.weight"].astype(np.float16)
    expect(ModelLoadError, validate_weights, c, bad, match="model.norm.weight has dtype float16, expected float32")
    bad = dict(w)
    bad["model.layers.0.mlp.gate_proj.weight"] = w["model.layers.0.mlp.gate_proj.weight"].astype(np.float32)
    expect(ModelLoadError, validate_weights, c, bad, match="gate_proj.weight has dtype float32")
    bad = dict(w)
    del bad["model.norm.weight"]
    expect(ModelLoadError, validate_weights, c, bad, match="missing tensor model.norm.weight")


@pytest.mark.parametrize("bias, tensor", [("attention_bias", r"self_attn\.o_proj\.bias"),
                                          ("mlp_bias", r"mlp\.(gate|up|down)_proj\.bias")])
def test_block_parameters_the_model_would_drop_are_refused(tmp_path, bias, tensor):
    """A Llama with biases cyllm does not apply (transformers gives o_proj a bias with
    attention_bias, every MLP projection one with mlp_bias) is refused by name: loading it
    without them would give wrong text and no error."""
    import tinymodels
    kind = f"llama_{bias}"
    tinymodels.KINDS[kind] = ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=96, **{bias: True}))
    try:
        d = make_tiny_model(tmp_path, kind)
    finally:
        del tinymodels.KINDS[kind]
    expect(UnsupportedModelError, load_hf_dir, d, match=rf"model\.layers\.\d+\.{tensor} is not part of a llama")
