"""Hostile files: configs with values of the wrong type or
range, sizes that would allocate before they are checked, GGUF metadata of the wrong shape,
and valid files with unusual alignment that must load.

Every refusal is one CyllmError line (exit status 2 and one line on the command line),
raised before anything large is allocated; the valid files give the same tensors as the
safetensors library and the gguf package read, and the same logits as their plain twins.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

import cyllm
import gguf_raw as G
from cyllm.errors import CyllmError, InvalidArgumentError, ModelLoadError, TokenizerError, UnsupportedModelError
from cyllm.jsonio import MAX_DEPTH, parse_json
from cyllm.loading import load_path
from hostile import problem, run_cli
from llamacpp_tools import family_gguf, family_material  # noqa: F401 (fixtures)
from tinymodels import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hard"), "llama_mqa_odd")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from test_gguf import write_tiny_gguf
    p = tmp_path_factory.mktemp("hardgguf") / "tiny.gguf"
    write_tiny_gguf(p)
    return p


def one_line_error(exc_type, fn, *args, needles=(), seconds: float = 5.0, **kw) -> str:
    """Call fn; it must raise exc_type, quickly, with a one-line message holding every needle."""
    t0 = time.monotonic()
    with pytest.raises(exc_type) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
    assert msg.isprintable(), repr(msg)
    for n in needles:
        assert n.lower() in msg.lower(), (n, msg)
    assert time.monotonic() - t0 < seconds, f"took {time.monotonic() - t0:.1f} s: {msg}"
    return msg


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(d: Path, name: str, change) -> None:
    p = d / name
    data = json.loads(p.read_text(encoding="utf-8"))
    change(data)
    p.write_text(json.dumps(data), encoding="utf-8")


def classic_rope(cfg: dict) -> None:
    """transformers 5 writes rope_parameters; older files use rope_theta/rope_scaling."""
    params = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = params.get("rope_theta", 10000.0)


# ============================================================================ class 1: config values

def _set(**kv):
    def change(cfg):
        classic_rope(cfg)
        cfg.update(kv)
    return change


CONFIG_CASES = {
    # name: (change, expected message parts)
    "architectures not a list": (_set(architectures="LlamaForCausalLM"), ["architectures", "list"]),
    "architectures of ints": (_set(architectures=[1]), ["architectures"]),
    "rope_theta a string": (_set(rope_theta="1e4"), ["rope_theta", "number"]),
    "rope_theta null": (_set(rope_theta=None), ["rope_theta"]),
    "rope_theta negative": (_set(rope_theta=-5.0), ["rope_theta"]),
    "rope_theta a flag": (_set(rope_theta=True), ["rope_theta"]),
    "rms_norm_eps zero": (_set(rms_norm_eps=0), ["rms_norm_eps"]),
    "rms_norm_eps a string": (_set(rms_norm_eps="1e-5"), ["rms_norm_eps"]),
    "llama3 low_freq_factor 0": (_set(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64}),
                                 ["low_freq_factor"]),
    "llama3 factor a string": (_set(rope_scaling={"rope_type": "llama3", "factor": "8",
                                                  "original_max_position_embeddings": 64}), ["factor"]),
    "linear factor a flag": (_set(rope_scaling={"rope_type": "linear", "factor": True}), ["factor"]),
    "linear factor 0": (_set(rope_scaling={"rope_type": "linear", "factor": 0}), ["factor"]),
    "rope_scaling a list": (_set(rope_scaling=[1, 2]), ["rope_scaling"]),
    "rope_type a number": (_set(rope_scaling={"rope_type": 5}), ["rope_type"]),
    "longrope factors of strings": (_set(rope_scaling={"rope_type": "longrope", "short_factor": ["1"] * 12,
                                                       "long_factor": ["1"] * 12,
                                                       "original_max_position_embeddings": 64}),
                                    ["short_factor"]),
    "longrope original context 1": (_set(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 12,
                                                       "long_factor": [1.0] * 12,
                                                       "original_max_position_embeddings": 1}),
                                    ["original_max_position_embeddings"]),
    "tie_word_embeddings a string": (_set(tie_word_embeddings="no"), ["tie_word_embeddings"]),
    "attention_bias a string": (_set(attention_bias="false"), ["attention_bias"]),
    "num_hidden_layers 10^7": (_set(num_hidden_layers=10 ** 7), ["num_hidden_layers"]),
    "num_attention_heads a float": (_set(num_attention_heads=3.0), ["num_attention_heads"]),
    "vocab_size 1e400": (None, ["vocab_size"]),
    "sliding_window 10^30": (_set(architectures=["MistralForCausalLM"], sliding_window=10 ** 30), ["sliding_window"]),
    "layer_types of numbers": (_set(architectures=["Qwen2ForCausalLM"], sliding_window=4, layer_types=[1, 2]),
                               ["layer_types"]),
    "layer_types unknown": (_set(architectures=["Qwen2ForCausalLM"], sliding_window=4,
                                 layer_types=["full_attention", "chunked_attention"]), ["layer_types"]),
    "no_rope_layers a string": (_set(architectures=["SmolLM3ForCausalLM"], no_rope_layers="ab"),
                                ["no_rope_layers"]),
    "gemma3 layers 10^9": (_set(architectures=["Gemma3ForCausalLM"], num_hidden_layers=10 ** 9),
                           ["num_hidden_layers"]),
    "gemma3 window pattern 0": (_set(architectures=["Gemma3ForCausalLM"], hidden_act="gelu_pytorch_tanh",
                                     sliding_window_pattern=0), ["sliding_window_pattern"]),
    "phi3 partial rotary NaN": (None, ["partial_rotary_factor"]),
    "rope_parameters per layer type not an object": (_set(rope_parameters={"full_attention": 5}),
                                                     ["full_attention"]),
}

RAW_CASES = {      # JSON text edits (what json.dumps cannot write)
    "vocab_size 1e400": ('"vocab_size": 400', '"vocab_size": 1e400'),
    "phi3 partial rotary NaN": ('"architectures": ["LlamaForCausalLM"]',
                                '"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": NaN'),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_values_refused(tiny, tmp_path, case):
    change, needles = CONFIG_CASES[case]
    d = copy_dir(tiny, tmp_path / "m")
    if change is not None:
        edit_json(d, "config.json", change)
    else:
        old, new = RAW_CASES[case]
        text = json.dumps(json.loads((d / "config.json").read_text()))
        assert old in text
        (d / "config.json").write_text(text.replace(old, new))
    one_line_error(ModelLoadError, load_path, d, needles=needles)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("attack", ["deep", "digits"])
def test_json_bounds(tiny, tmp_path, name, attack):
    """50,000 nested brackets (RecursionError in json) and an integer of 5,000 digits (ValueError)."""
    d = copy_dir(tiny, tmp_path / "m")
    text = (d / name).read_text().rstrip()
    bomb = "[" * 50000 + "]" * 50000 if attack == "deep" else "9" * 5000
    (d / name).write_text(text[:-1] + f', "x": {bomb}}}')
    one_line_error(CyllmError, load_path, d, needles=[name, "deep" if attack == "deep" else "digits"])


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_config_files_that_are_not_regular_files(tiny, tmp_path, name, kind):
    """A FIFO would block a read forever and /dev/zero never end it: info and generate refuse
    such a file (or go on without an optional one) within the hostile-input limits."""
    d = copy_dir(tiny, tmp_path / "m")
    (d / name).unlink()
    if kind == "fifo":
        os.mkfifo(d / name)
    else:
        (d / name).symlink_to("/dev/zero")
    for argv in (["info", "-m", str(d)], ["generate", "-m", str(d), "-p", "hi", "-n", "1", "--no-stats"]):
        code, err = run_cli(argv)
        assert problem(code, err) is None, (argv, code, err[-300:])


def test_shard_index_bounds(tmp_path):
    d = make_tiny_model(tmp_path, "llama_tied", dtype="bfloat16", sharded=True)
    index = d / "model.safetensors.index.json"
    spec = json.loads(index.read_text())
    index.write_text(json.dumps({**spec, "metadata": "x"})[:-1] + ', "deep": ' + "[" * 50000 + "]" * 50000 + "}")
    one_line_error(ModelLoadError, load_path, d, needles=["index", "deep"])
    index.write_text(json.dumps({"weight_map": [1, 2]}))
    one_line_error(ModelLoadError, load_path, d, needles=["weight_map"])


def test_parse_json_limits():
    assert parse_json('{"a": [1, {"b": "[[[["}], "c": 1000000000000000019884624838656}', "x") == {
        "a": [1, {"b": "[[[["}], "c": 1000000000000000019884624838656}
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(ok, "x") == eval(ok)
    one_line_error(ModelLoadError, parse_json, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "x", needles=["deep"])
    one_line_error(ModelLoadError, parse_json, b"\xff\xfe", "x", needles=["UTF-8"])
    # unterminated strings full of escaped quotes: the bracket scan must stay linear
    for tail in ("", "\\"):
        one_line_error(ModelLoadError, parse_json, '{"a": "' + 'x\\"' * 300000 + tail, "x", needles=["JSON"],
                       seconds=2.0)


def test_tokenizer_config_types(tiny, tmp_path):
    d = copy_dir(tiny, tmp_path / "m")
    edit_json(d, "tokenizer_config.json", lambda c: c.update(chat_template=[1, {"name": [1]}]))
    one_line_error(TokenizerError, load_path, d, needles=["chat_template"])
    edit_json(d, "tokenizer_config.json", lambda c: c.update(chat_template=None, bos_token=[1, 2]))
    one_line_error(TokenizerError, load_path, d, needles=["bos_token"])


def test_valid_config_variants_still_load(tiny, tmp_path):
    """What real files hold: 31-digit model_max_length, null head_dim and window, -1 ids, classic rope keys."""
    d = copy_dir(tiny, tmp_path / "m")
    edit_json(d, "tokenizer_config.json", lambda c: c.update(model_max_length=1000000000000000019884624838656))
    edit_json(d, "config.json", lambda c: (classic_rope(c), c.update(sliding_window=None, pad_token_id=-1,
                                                                      eos_token_id=[2, -1], rope_scaling=None)))
    edit_json(d, "generation_config.json", lambda c: c.update(eos_token_id=[2, 10 ** 12]))
    cfg, _, tok = load_path(d)
    assert cfg.eos_token_ids == [2] and cfg.rope_theta == 10000.0 and tok is not None


def test_configs_transformers_writes(tmp_path):
    """config.json of every supported family as transformers writes it: the values it holds."""
    transformers = pytest.importorskip("transformers")
    from cyllm.families import config_from_hf
    from cyllm.jsonio import read_json_file
    cases = {
        "llama3": transformers.LlamaConfig(num_hidden_layers=3, rope_theta=500000.0, max_position_embeddings=131072,
                                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}),
        "qwen2": transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=128,
                                          max_window_layers=2),
        "gemma3": transformers.Gemma3TextConfig(num_hidden_layers=7),
        "phi3": transformers.Phi3Config(num_hidden_layers=2, partial_rotary_factor=0.5),
        "smollm3": transformers.SmolLM3Config(num_hidden_layers=8),
    }
    for name, hf in cases.items():
        d = tmp_path / name
        hf.save_pretrained(d)
        c = config_from_hf(read_json_file(d / "config.json"))
        assert (c.n_layers, c.dim, c.n_heads, c.vocab_size) == (hf.num_hidden_layers, hf.hidden_size,
                                                                hf.num_attention_heads, hf.vocab_size), name
        assert c.norm_eps == pytest.approx(hf.rms_norm_eps), name
    c = config_from_hf(read_json_file(tmp_path / "gemma3" / "config.json"))
    assert c.layer_types == tuple("sliding" if t == "sliding_attention" else "full"
                                  for t in cases["gemma3"].layer_types)
    assert config_from_hf(read_json_file(tmp_path / "phi3" / "config.json")).rotary_dim == \
        int(cases["phi3"].hidden_size // cases["phi3"].num_attention_heads * 0.5)


def test_gemma2_keys_a_config_leaves_out_take_transformers_defaults():
    """A Gemma 2 config.json without its caps, window, layer types, query scale or head_dim is
    the model transformers' Gemma2Config makes of it (50, 30, 4096 every other layer, 256, 256);
    a null cap or window turns that feature off in both."""
    transformers = pytest.importorskip("transformers")
    from cyllm.families import config_from_hf
    keys = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types",
            "query_pre_attn_scalar", "head_dim")
    full = dict(transformers.Gemma2Config(num_hidden_layers=4).to_dict(), architectures=["Gemma2ForCausalLM"])
    for d in ({k: v for k, v in full.items() if k not in keys},
              dict(full, attn_logit_softcapping=None, final_logit_softcapping=None)):
        hf = transformers.Gemma2Config(**{k: v for k, v in d.items() if k != "architectures"})
        c = config_from_hf(d)
        assert (c.attn_softcap or None, c.final_softcap or None) == (hf.attn_logit_softcapping,
                                                                    hf.final_logit_softcapping)
        assert (c.sliding_window, c.head_dim, c.attn_scale) == (hf.sliding_window, hf.head_dim,
                                                                 hf.query_pre_attn_scalar ** -0.5)
        assert c.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)


def _minimal_configs():
    """(family, HF architecture, model_type): every architecture cyllm reads."""
    from cyllm.families import FAMILIES
    return [(f.name, arch, mt) for f in FAMILIES for arch, mt in zip(f.hf_architectures, f.hf_model_types)]


@pytest.mark.parametrize("fam,arch,model_type", _minimal_configs())
def test_keys_left_out_take_the_config_class_defaults(fam, arch, model_type):
    """A config.json with only the sizes: the norm epsilon, trained context, rope base and
    tying are those of the family's own transformers config class (Qwen2's 1e-6 and 32768,
    SmolLM3's tied 2e6 rope, ...), not one set of defaults for every family."""
    transformers = pytest.importorskip("transformers")
    from cyllm.families import config_from_hf
    raw = dict(architectures=[arch], model_type=model_type, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    if fam in ("qwen3moe", "olmoe"):
        raw.update(num_experts=4, num_experts_per_tok=2)
    if fam in ("mixtral", "granitemoe"):
        raw.update(num_local_experts=4, num_experts_per_tok=2)
    cls = getattr(transformers, "Gemma3TextConfig" if arch == "Gemma3ForCausalLM" else arch.replace("ForCausalLM", "Config"))
    hf = cls(**{k: v for k, v in raw.items() if k != "architectures"})
    c = config_from_hf(raw)
    assert c.norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-12)
    assert (c.max_seq_len, c.tie_word_embeddings) == (hf.max_position_embeddings, bool(hf.tie_word_embeddings))
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta")
    assert theta is None or c.rope_theta == theta          # Gemma 3, OLMo 3: a base a layer type


def test_ernie4_5_biases_refused():
    """Ernie 4.5 with use_bias (biases on every linear layer, which cyllm does not apply): one
    clear error, not a model run without them."""
    from cyllm.errors import UnsupportedModelError
    from cyllm.families import config_from_hf
    raw = dict(architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    assert config_from_hf(dict(raw)).arch == "ernie4_5"
    with pytest.raises(UnsupportedModelError, match="use_bias"):
        config_from_hf(dict(raw, use_bias=True))


def test_hunyuan_dense_config():
    """Hunyuan dense: the releases' "dynamic" rope with a fixed alpha read as transformers reads
    it (a base stretched to theta * alpha^(d / (d - 2)), no scaling), the end-of-document id
    an end of text too; CLA and biases, which cyllm does not apply, refused in one line, and a
    bad alpha or a truly dynamic rope (no alpha) too."""
    from cyllm.errors import CyllmError, UnsupportedModelError
    from cyllm.families import config_from_hf
    raw = dict(architectures=["HunYuanDenseV1ForCausalLM"], model_type="hunyuan_v1_dense", hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
               eos_token_id=2, eod_token_id=7,
               rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0}, rope_theta=10000.0)
    c = config_from_hf(dict(raw))
    assert (c.arch, c.qk_norm, c.qk_norm_after_rope, c.rope_scaling) == ("hunyuan_dense", True, True, None)
    assert math.isclose(c.rope_theta, 10000.0 * 1000.0 ** (16 / 14))
    assert c.eos_token_ids == [2, 7]
    for key in ("use_cla", "attention_bias", "mlp_bias"):
        with pytest.raises(UnsupportedModelError, match=key):
            config_from_hf(dict(raw, **{key: True}))
    for bad in ("x", -1.0, 0, float("nan"), 10 ** 400, 1e300):        # the last two: theta past float range
        with pytest.raises(CyllmError, match="alpha"):
            config_from_hf(dict(raw, rope_scaling={"type": "dynamic", "alpha": bad}))
    with pytest.raises(CyllmError, match="dynamic"):
        config_from_hf(dict(raw, rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_glm4_config():
    """GLM-4: half of each head rotates where config.json says nothing (Glm4Config's default),
    the share it gives otherwise; a share that leaves an odd number of dims, and GLM-4V's
    multimodal rope, refused in one line."""
    from cyllm.errors import CyllmError, UnsupportedModelError
    from cyllm.families import config_from_hf
    raw = dict(architectures=["Glm4ForCausalLM"], model_type="glm4", hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=100)
    c = config_from_hf(dict(raw))
    assert (c.arch, c.rotary_dim, c.post_norms, c.attention_bias) == ("glm4", 16, True, True)
    assert config_from_hf(dict(raw, partial_rotary_factor=1.0)).rotary_dim is None
    assert config_from_hf(dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.25})).rotary_dim == 8
    with pytest.raises(CyllmError, match="partial_rotary_factor"):
        config_from_hf(dict(raw, partial_rotary_factor=0.3))           # 9.6 -> 9 dims
    with pytest.raises(UnsupportedModelError, match="mrope"):
        config_from_hf(dict(raw, rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12]}))


def test_seed_oss_defaults_and_refused_biases():
    """Seed-OSS: keys a config.json leaves out take transformers' SeedOssConfig defaults (q/k/v
    biases, head_dim 128, eps 1e-6); biases on o_proj or the MLP, which cyllm does not apply,
    are one clear error rather than ignored tensors."""
    transformers = pytest.importorskip("transformers")
    from cyllm.errors import UnsupportedModelError
    from cyllm.families import config_from_hf
    full = dict(transformers.SeedOssConfig(num_hidden_layers=2).to_dict(), architectures=["SeedOssForCausalLM"])
    bare = {k: v for k, v in full.items() if k not in ("attention_bias", "head_dim", "rms_norm_eps")}
    hf = transformers.SeedOssConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    c = config_from_hf(bare)
    assert (c.attention_bias, c.head_dim, c.norm_eps) == (hf.attention_bias, hf.head_dim, hf.rms_norm_eps)
    for key in ("attention_out_bias", "mlp_bias"):
        with pytest.raises(UnsupportedModelError):
            config_from_hf(dict(full, **{key: True}))


def test_gemma_activation_is_transformers_choice():
    """Gemma 1: transformers' GemmaConfig runs hidden_act, the approximate GELU where it is absent,
    and the released config.json files' "gelu" as that too; an activation cyllm has no kernel
    for is one clear error."""
    transformers = pytest.importorskip("transformers")
    from cyllm.errors import UnsupportedModelError
    from cyllm.families import config_from_hf
    full = dict(transformers.GemmaConfig(num_hidden_layers=2).to_dict(), architectures=["GemmaForCausalLM"])
    for d in (dict(full, hidden_act="gelu"), {k: v for k, v in full.items() if k != "hidden_act"},
              dict(full, hidden_act="gelu_pytorch_tanh")):
        hf = transformers.GemmaConfig(**{k: v for k, v in d.items() if k != "architectures"})
        assert hf.hidden_act == "gelu_pytorch_tanh"
        c = config_from_hf(d)
        assert c.activation == "gelu_tanh" and c.head_dim == hf.head_dim and c.tie_word_embeddings
    with pytest.raises(UnsupportedModelError):
        config_from_hf(dict(full, hidden_act="relu"))


# ============================================================================ class 2: sizes before allocation

def test_context_beyond_any_model(tiny):
    one_line_error(InvalidArgumentError, cyllm.load, tiny, backend="numpy", context=10 ** 12, needles=["context"])


def test_context_beyond_memory_is_refused_before_allocating(tiny):
    """Under a 1.5 GB address-space limit, -c 10^7 (7.5 GB of KV cache and rope tables) is one line."""
    code, err = run_cli(["generate", "-m", str(tiny), "-p", "hi", "-c", "10000000", "-n", "1"], mem_mb=1536)
    assert problem(code, err) is None and code == 2, err
    assert "available" in err and "context" in err


def test_bench_huge_prompt(tiny):
    code, err = run_cli(["bench", "-m", str(tiny), "-p", "1000000000", "-n", "0", "-r", "1", "--no-progress"],
                        mem_mb=1536)
    assert problem(code, err) is None and code == 2, err


def test_memory_estimate_covers_what_is_allocated(tiny):
    """The estimate counts the KV cache exactly and at least the rope tables the model builds."""
    from cyllm.memory import state_bytes
    model = cyllm.load(tiny, backend="numpy", context=300)
    c = model.config
    kv = sum(L.k_cache.nbytes + L.v_cache.nbytes for L in model.layers)
    tables = {id(L.rope[0]): L.rope for L in model.layers if L.rope is not None}
    rope = sum(cos.nbytes + sin.nbytes for cos, sin in tables.values())
    per_pos, _ = state_bytes(c, 300)
    assert kv == c.kv_bytes_per_token() * 300
    assert (per_pos - c.kv_bytes_per_token()) * 300 >= rope > 0


def test_gguf_block_count(tiny_gguf, tmp_path):
    for count, needle in ((10 ** 7, "block_count"), (4096, "blocks")):
        g = G.RawGGUF.parse(tiny_gguf.read_bytes())
        g.set("llama.block_count", G.UINT32, count)
        p = tmp_path / f"b{count}.gguf"
        p.write_bytes(g.to_bytes())
        one_line_error(ModelLoadError, load_path, p, needles=[needle])


def test_gguf_tensors_that_share_bytes(tiny_gguf, tmp_path):
    """Tensors pointing at one another's bytes are refused (a small file whose every layer
    points at the same bytes asked for memory by its layer count); tensors laid out in another
    order than declared, without overlap, still load."""
    g = G.RawGGUF.parse(tiny_gguf.read_bytes())
    norms = [t for t in g.tensors if t[0].endswith("_norm.weight")]
    assert len(norms) >= 2 and norms[0][1] == norms[1][1] and norms[0][2] == norms[1][2]
    swapped = _gguf_with(tiny_gguf, tmp_path, "swapped.gguf", lambda g: _swap_offsets(g, norms[0][0], norms[1][0]))
    load_path(swapped)
    shared = _gguf_with(tiny_gguf, tmp_path, "shared.gguf",
                        lambda g: _set_offset(g, norms[1][0], norms[0][3] + 4))
    one_line_error(ModelLoadError, load_path, shared, needles=["overlap", norms[0][0], norms[1][0]])


def _swap_offsets(g, a, b) -> None:
    ta, tb = (next(t for t in g.tensors if t[0] == n) for n in (a, b))
    ta[3], tb[3] = tb[3], ta[3]


def _set_offset(g, name, offset) -> None:
    next(t for t in g.tensors if t[0] == name)[3] = offset


def test_safetensors_tensors_that_share_bytes(tiny, tmp_path):
    d = copy_dir(tiny, tmp_path / "m")
    f = d / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    names = sorted(k for k in header if k.endswith("layernorm.weight"))
    a, b = header[names[0]], header[names[1]]
    assert a["shape"] == b["shape"] and a["dtype"] == b["dtype"]
    b["data_offsets"] = [a["data_offsets"][0] + 2, a["data_offsets"][1] + 2]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))              # the same header length: the data stays in place
    assert len(text) == n
    f.write_bytes(raw[:8] + text + raw[8 + n:])
    one_line_error(ModelLoadError, load_path, d, needles=["overlap"])


# ============================================================================ class 3: GGUF metadata shapes

def _gguf_with(tiny_gguf, tmp_path, name, edit) -> Path:
    g = G.RawGGUF.parse(tiny_gguf.read_bytes())
    edit(g)
    p = tmp_path / name
    p.write_bytes(g.to_bytes())
    return p


def test_gguf_arrays_nested_deep(tiny_gguf, tmp_path):
    p = _gguf_with(tiny_gguf, tmp_path, "deep.gguf", lambda g: g.set("x.deep", G.ARRAY, G.nested_array(50000)))
    one_line_error(ModelLoadError, load_path, p, needles=["nests"])


def test_gguf_nested_arrays_read_as_the_gguf_package_reads_them(tiny_gguf, tmp_path):
    gguf = pytest.importorskip("gguf")
    from cyllm.loading.gguf import read_gguf
    nested = G.Array(G.ARRAY, [G.Array(G.INT32, [1, 2, 3]), G.Array(G.INT32, [4])])
    p = _gguf_with(tiny_gguf, tmp_path, "nested.gguf", lambda g: g.set("x.nested", G.ARRAY, nested))
    ours = read_gguf(p).metadata["x.nested"]
    field = gguf.GGUFReader(p).fields["x.nested"]
    theirs = [int(field.parts[i][0]) for i in field.data]     # the gguf package lists the leaves
    assert [list(a) for a in ours] == [[1, 2, 3], [4]]
    assert [x for a in ours for x in a] == theirs


TOKENIZER_CASES = {
    "token_type a scalar": (lambda g: g.set("tokenizer.ggml.token_type", G.INT32, 1), ["token_type"]),
    "token_type strings": (lambda g: g.set("tokenizer.ggml.token_type", G.ARRAY,
                                           G.Array(G.STRING, ["a"] * len(g.get("tokenizer.ggml.tokens").items))),
                           ["token_type"]),
    "scores strings": (lambda g: g.set("tokenizer.ggml.scores", G.ARRAY,
                                       G.Array(G.STRING, ["a"] * len(g.get("tokenizer.ggml.tokens").items))),
                       ["scores"]),
    "merges of numbers": (lambda g: g.set("tokenizer.ggml.merges", G.ARRAY, G.Array(G.INT32, [1, 2])),
                          ["merges"]),
    "add_bos_token a string": (lambda g: g.set("tokenizer.ggml.add_bos_token", G.STRING, "false"),
                               ["add_bos_token"]),
    "chat_template a number": (lambda g: g.set("tokenizer.chat_template", G.INT32, 5), ["chat_template"]),
    "a token of a million characters": (lambda g: g.get("tokenizer.ggml.tokens").items.__setitem__(300, "a" * 10 ** 6),
                                        ["characters"]),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CASES))
def test_gguf_tokenizer_metadata_refused(tiny_gguf, tmp_path, case):
    edit, needles = TOKENIZER_CASES[case]
    p = _gguf_with(tiny_gguf, tmp_path, "t.gguf", edit)
    one_line_error(TokenizerError, load_path, p, needles=needles)


def test_gguf_quadratic_vocabulary(tiny_gguf, tmp_path):
    """Tokens growing by one character each: 8 GB of pieces to split were it not bounded."""
    from cyllm.loading.gguf import read_gguf
    from cyllm.loading.gguf_tokenizer import build_tokenizer
    n = 3000
    toks = ["<unk>", "<s>", "</s>"] + ["\u2581" + "a" * i for i in range(1, n)]

    def edit(g):
        g.set("tokenizer.ggml.tokens", G.ARRAY, G.Array(G.STRING, toks))
        g.set("tokenizer.ggml.scores", G.ARRAY, G.Array(G.FLOAT32, [0.0] * len(toks)))
        g.set("tokenizer.ggml.token_type", G.ARRAY, G.Array(G.INT32, [1] * len(toks)))
    p = _gguf_with(tiny_gguf, tmp_path, "quad.gguf", edit)
    one_line_error(TokenizerError, build_tokenizer, read_gguf(p), needles=["merges"])


# ============================================================================ class 9: valid files, odd alignment

def _logits(path, backend) -> np.ndarray:
    m = cyllm.load(path, backend=backend)
    return m.logits([1, 5, 9, 13]).copy()


def test_safetensors_header_not_a_multiple_of_8(tiny, tmp_path, host_backend):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    d = copy_dir(tiny, tmp_path / "odd")
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].rstrip(b" ")
    header += b" " * (1 if len(header) % 2 == 0 else 2)       # odd length: every tensor misaligned
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    reference = safetensors_numpy.load_file(str(d / "model.safetensors"))   # the format's own reader
    from cyllm.loading.safetensors import load_safetensors
    ours = load_safetensors(d / "model.safetensors")
    for name, a in reference.items():
        assert ours[name].flags.aligned
        np.testing.assert_array_equal(ours[name], a)
    np.testing.assert_array_equal(_logits(d, host_backend), _logits(tiny, host_backend))


@pytest.mark.parametrize("alignment", [1, 2, 8])
def test_gguf_any_alignment(tiny_gguf, tmp_path, alignment, host_backend):
    gguf = pytest.importorskip("gguf")
    from cyllm.loading.gguf import _dequantize, read_gguf
    g = G.relayout(G.RawGGUF.parse(tiny_gguf.read_bytes()), alignment)
    p = tmp_path / f"a{alignment}.gguf"
    p.write_bytes(g.to_bytes())
    gf = read_gguf(p)
    reference = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(p).tensors}
    for name, info in gf.tensors.items():
        a = _dequantize(gf, info)
        assert a.flags.aligned, name
        np.testing.assert_array_equal(a.reshape(reference[name].shape), reference[name])
    np.testing.assert_array_equal(_logits(p, host_backend), _logits(tiny_gguf, host_backend))


# ============================================================================ messages stay one line

def test_messages_quote_paths_and_names_on_one_line(tiny, tmp_path, tiny_gguf):
    d = copy_dir(tiny, tmp_path / "evil\nline\x1b[2J")
    edit_json(d, "config.json", lambda c: c.update(hidden_size="x"))
    msg = one_line_error(ModelLoadError, load_path, d)
    assert "\\n" in msg
    # a tensor name with a newline in a safetensors header
    d2 = copy_dir(tiny, tmp_path / "m2")
    raw = (d2 / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header["bad\nname"] = dict(header.pop(name), dtype="Q7")
    h = json.dumps(header).encode()
    (d2 / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    one_line_error(ModelLoadError, load_path, d2, needles=["bad\\nname"])
    # a GGUF at a path with a newline, holding an architecture name with one
    p = tmp_path / "x\ny.gguf"
    g = G.RawGGUF.parse(tiny_gguf.read_bytes())
    g.set("general.architecture", G.STRING, "evil\narch")
    p.write_bytes(g.to_bytes())
    one_line_error(ModelLoadError, load_path, p)


def test_tokenizer_regex_that_backtracks_forever(tiny, tmp_path):
    """A pre-tokenizer regex of a hostile tokenizer.json: Oniguruma stops it at its retry limit and
    the library panics (a BaseException); cyllm turns that into one TokenizerError line."""
    d = copy_dir(tiny, tmp_path / "m")
    edit_json(d, "tokenizer.json", lambda t: t.update(pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}))
    tok = load_path(d)[2]
    assert tok.encode("ab") is not None
    one_line_error(TokenizerError, tok.encode, "a" * 40 + "b", needles=["tokenizer"])


@pytest.mark.parametrize("step,needle", [
    # a charsmap whose trie size (0xFFFFFFFF) lies: the library asked for 8 GB, then panicked
    ({"type": "Precompiled", "precompiled_charsmap": "/////w=="}, "charsmap"),
    # the library indexes past the text and panics (Rust's panic text on stderr)
    ({"type": "Replace", "pattern": {"String": ""}, "content": "x"}, "empty pattern"),
    ({"type": "Sequence", "normalizers": [{"type": "NFC"},
                                          {"type": "Replace", "pattern": {"Regex": ""}, "content": "x"}]},
     "empty pattern")])
def test_tokenizer_steps_the_library_panics_on(tiny, tmp_path, step, needle):
    d = copy_dir(tiny, tmp_path / "m")
    edit_json(d, "tokenizer.json", lambda t: t.update(normalizer=step))
    one_line_error(TokenizerError, load_path, d, needles=[needle])
    # the step's name spelled with a JSON escape is the same step to the library
    p = d / "tokenizer.json"
    for name in ("Precompiled", "Replace"):
        p.write_text(p.read_text().replace(f'"{name}"', '"' + name[:3] + "\\u%04x" % ord(name[3]) + name[4:] + '"'))
    assert '"Precompiled"' not in p.read_text() and '"Replace"' not in p.read_text()
    one_line_error(TokenizerError, load_path, d, needles=[needle])


def test_special_token_with_a_lone_surrogate(tiny, tmp_path):
    """A JSON escape can leave a lone surrogate in bos_token, which the library cannot look up."""
    d = copy_dir(tiny, tmp_path / "m")
    edit_json(d, "tokenizer_config.json", lambda c: c.update(bos_token="\udc80"))
    one_line_error(TokenizerError, load_path, d, needles=["bos_token", "surrogate"])


# ============================================================================ class 5: values float32 cannot carry
# Finite in the file or in float64, but NaN or inf where the engine computes (float16 weights,
# float32 tables): refused with one line, never turned into text.

def _patched(tiny_gguf, tmp_path, name, tensor, index, value) -> Path:
    """The tiny F16 GGUF with element ``index`` of ``tensor`` set to ``value``."""
    g = G.RawGGUF.parse(tiny_gguf.read_bytes())
    off = next(t[3] for t in g.tensors if t[0] == tensor)
    data = bytearray(g.data)
    data[off + 2 * index:off + 2 * index + 2] = np.float16(value).tobytes()
    g.data = bytes(data)
    p = tmp_path / name
    p.write_bytes(g.to_bytes())
    return p


@pytest.mark.parametrize("tensor", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weight_is_an_error_not_text(tiny_gguf, tmp_path, tensor, value):
    """One nan or inf among F16 weights: the cpu kernels' softmax exponent once clamped a NaN score
    into a finite one, so a corrupt q or k matrix generated text; now the logits check stops it."""
    p = _patched(tiny_gguf, tmp_path, "bad.gguf", tensor, 5, value)
    code, err = run_cli(["generate", "-m", str(p), "-p", "hi there", "-n", "4", "--temp", "0"])
    assert code == 2 and problem(code, err) is None, (code, err)
    assert "not finite" in err


@pytest.mark.parametrize("key,vtype,value,needle", [
    ("llama.rope.freq_base", G.FLOAT64, 1e39, "theta"),
    ("llama.attention.layer_norm_rms_epsilon", G.FLOAT64, 1e300, "rms_norm_eps"),
    ("llama.attention.layer_norm_rms_epsilon", G.FLOAT64, 1e-50, "rms_norm_eps"),
])
def test_values_beyond_float32_refused(tiny_gguf, tmp_path, key, vtype, value, needle):
    p = _gguf_with(tiny_gguf, tmp_path, "f32.gguf", lambda g: g.set(key, vtype, value))
    one_line_error(ModelLoadError, load_path, p, needles=[needle, "float32"])


def test_rope_scaling_beyond_float32_refused(tiny_gguf, tmp_path):
    """A linear factor so small that the scaled frequencies overflow float32: cos and sin of inf
    are nan (with numpy's warnings on stderr before); refused where the tables are made."""
    def edit(g):
        g.set("llama.rope.scaling.type", G.STRING, "linear")
        g.set("llama.rope.scaling.factor", G.FLOAT32, 1e-45)
    p = _gguf_with(tiny_gguf, tmp_path, "scale.gguf", edit)
    code, err = run_cli(["generate", "-m", str(p), "-p", "hi", "-n", "2"])
    assert code == 2 and problem(code, err) is None, (code, err)
    assert "float32" in err and "Warning" not in err


def test_gguf_token_list_shorter_than_the_embedding(tiny_gguf, tmp_path):
    """llama.cpp refuses it too: a sampled id past the list would stop the text midway."""
    g = G.RawGGUF.parse(tiny_gguf.read_bytes())
    n = len(g.get("tokenizer.ggml.tokens").items)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        a = g.get(key)
        g.set(key, G.ARRAY, G.Array(a.etype, a.items[:n - 7]))
    p = tmp_path / "short.gguf"
    p.write_bytes(g.to_bytes())
    one_line_error(TokenizerError, load_path, p, needles=[f"{n - 7} tokens", f"{n}"])


def test_perplexity_beyond_float64_is_inf():
    from cyllm.tools.perplexity import format_ppl, ppl_from_sums
    ppl, err = ppl_from_sums(800.0 * 64, 640000.0 * 64, 64)       # a mean of 800 nats a token
    assert ppl == float("inf") and err == float("inf")
    assert format_ppl(ppl, err) == "PPL = inf +/- inf"
    assert ppl_from_sums(2.0 * 10, 4.5 * 10, 10)[0] == pytest.approx(np.exp(2.0))


def _yarn(g, **extra) -> None:
    g.set("llama.rope.scaling.type", G.STRING, "yarn")
    g.set("llama.rope.scaling.factor", G.FLOAT32, 4.0)
    g.set("llama.rope.scaling.original_context_length", G.UINT32, 64)
    for key, value in extra.items():
        g.set(f"llama.rope.scaling.{key}", G.FLOAT32, value)


def test_gguf_yarn_read_and_its_other_keys_refused(tiny_gguf, tmp_path):
    """YaRN as llama.cpp's converter writes it loads; the keys whose meaning llama.cpp
    defines per architecture (an attention factor, a log multiplier) are refused by name."""
    p = _gguf_with(tiny_gguf, tmp_path, "yarn.gguf", _yarn)
    scaling = load_path(p)[0].rope_scaling
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                       "beta_fast": 32.0, "beta_slow": 1.0}
    for key in ("yarn_attn_factor", "yarn_log_multiplier"):
        p = _gguf_with(tiny_gguf, tmp_path, f"yarn_{key}.gguf", lambda g: _yarn(g, **{key: 0.5}))
        one_line_error(UnsupportedModelError, load_path, p, needles=[key])


def test_quantize_counts_nested_metadata_arrays(tiny_gguf, tmp_path):
    """Arrays of arrays count through: 17 x 65536 empty strings passed a top-level count of 17,
    and the gguf package's reader then held ~1.7 KB a string (5 GB for 3 M of them)."""
    from cyllm.tools.quantize import quantize
    p = _gguf_with(tiny_gguf, tmp_path, "n.gguf", lambda g: g.set(
        "x.junk", G.ARRAY, G.Array(G.ARRAY, [G.Array(G.STRING, [""] * 65536) for _ in range(17)])))
    one_line_error(ModelLoadError, quantize, p, tmp_path / "q.gguf", "q8_0", needles=["entries"], seconds=30)
    assert not list(tmp_path.glob("*q.gguf*"))


def test_convert_onto_a_directory_named_tokenizer_json(tiny_gguf, tmp_path):
    """The tokenizer is written as any other file: a failure (here a directory in its way; a full
    disk alike) is an OSError, which the command line reports in one line, not the library's
    plain Exception (an internal error, exit status 3)."""
    from cyllm.tools.convert import convert_gguf_to_hf
    out = tmp_path / "out"
    (out / "tokenizer.json").mkdir(parents=True)
    one_line_error(OSError, convert_gguf_to_hf, tiny_gguf, out, overwrite=True, needles=["tokenizer.json"],
                   seconds=30)


def test_gguf_writer_refuses_models_llama_cpp_would_read_otherwise():
    """cyllm quantize writes no Gemma 2 whose layers llama.cpp's fixed pattern (every other one
    sliding, from the first) or default caps would change, and no Gemma 3 with caps (its
    architecture reads none); the usual layout writes."""
    transformers = pytest.importorskip("transformers")
    from cyllm.families import config_from_hf, family
    from cyllm.tools.hf_gguf import _hparams
    g2 = dict(transformers.Gemma2Config(num_hidden_layers=4).to_dict(), architectures=["Gemma2ForCausalLM"])
    _hparams(config_from_hf(g2), family("gemma2"), g2, "ok")
    g3 = dict(transformers.Gemma3TextConfig(num_hidden_layers=6).to_dict(), architectures=["Gemma3ForCausalLM"])
    for fam, d in (("gemma2", dict(g2, sliding_window=None)),
                   ("gemma2", dict(g2, layer_types=["full_attention", "sliding_attention"] * 2)),
                   ("gemma2", dict(g2, final_logit_softcapping=None)),
                   ("gemma3", dict(g3, final_logit_softcapping=30.0))):
        one_line_error(UnsupportedModelError, _hparams, config_from_hf(d), family(fam), d, "x", needles=[fam[:5]])


def test_quantize_reads_the_tokenizer_as_loading_does(tiny, tmp_path):
    """cyllm quantize refuses a tokenizer.json that loading refuses (a merge of tokens the vocabulary
    lacks), before writing: it wrote such a GGUF, which then failed to load."""
    from cyllm.tools.quantize import quantize
    d = copy_dir(tiny, tmp_path / "m")
    edit_json(d, "tokenizer.json", lambda t: t["model"]["merges"].append(["zzqq", "qqzz"]))
    with pytest.raises(CyllmError):
        load_path(d)
    with pytest.raises(CyllmError):
        quantize(d, tmp_path / "q.gguf", "q8_0")
    assert not list(tmp_path.glob("*q.gguf*"))


def test_gemma3_keys_a_config_leaves_out_take_transformers_defaults():
    """The same for Gemma 3 (Gemma3TextConfig): head_dim and query_pre_attn_scalar 256, a 4096
    window in its 5:1 pattern, rope bases 1e6 and 10000."""
    transformers = pytest.importorskip("transformers")
    from cyllm.families import config_from_hf
    keys = ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types", "rope_parameters",
            "rope_theta", "rope_local_base_freq", "rope_scaling")
    full = dict(transformers.Gemma3TextConfig(num_hidden_layers=7).to_dict(), architectures=["Gemma3ForCausalLM"])
    d = {k: v for k, v in full.items() if k not in keys}
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in d.items() if k != "architectures"})
    c = config_from_hf(d)
    assert (c.head_dim, c.attn_scale, c.sliding_window) == (hf.head_dim, hf.query_pre_attn_scalar ** -0.5,
                                                            hf.sliding_window)
    assert c.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
    assert (c.rope_theta, c.rope_local_theta) == (hf.rope_parameters["full_attention"]["rope_theta"],
                                                  hf.rope_parameters["sliding_attention"]["rope_theta"])


# A mixture-of-experts file whose expert metadata lies or asks for what cyllm does not run: one
# line each, before any expert matrix is read (llama.cpp's converter's Qwen3-MoE file, edited)
_P = "qwen3moe."
MOE_CASES = {
    "too many experts": (lambda g: g.set(_P + "expert_count", G.UINT32, 5000), CyllmError, ["n_experts"]),
    "no experts but expert tensors": (lambda g: g.set(_P + "expert_count", G.UINT32, 0), CyllmError,
                                      ["expert_count"]),
    "a count the tensors do not have": (lambda g: g.set(_P + "expert_count", G.UINT32, 7), ModelLoadError,
                                        ["_exps.weight", "shape"]),
    "more used than there are": (lambda g: g.set(_P + "expert_used_count", G.UINT32, 9), ModelLoadError,
                                 ["9 experts used", "6"]),
    "none used": (lambda g: g.set(_P + "expert_used_count", G.UINT32, 0), ModelLoadError, ["between 1"]),
    "no used count": (lambda g: g.remove(_P + "expert_used_count"), ModelLoadError, ["n_experts_used"]),
    "a string count": (lambda g: g.set(_P + "expert_used_count", G.STRING, "2"), ModelLoadError,
                       ["n_experts_used"]),
    "sigmoid gating": (lambda g: g.set(_P + "expert_gating_func", G.UINT32, 2), UnsupportedModelError,
                       ["gating"]),
    "a weight scale": (lambda g: g.set(_P + "expert_weights_scale", G.FLOAT32, 2.5), UnsupportedModelError,
                       ["scale"]),
    "shared experts": (lambda g: g.set(_P + "expert_shared_count", G.UINT32, 1), UnsupportedModelError,
                       ["shared"]),
    "an expert size the tensors do not have": (lambda g: g.set(_P + "expert_feed_forward_length", G.UINT32, 41),
                                               ModelLoadError, ["shape"]),
    "an array of counts": (lambda g: g.set(_P + "expert_count", G.ARRAY, G.Array(G.UINT32, [6, 6])),
                           ModelLoadError, ["expert_count", "single value"]),
    "an array of gating functions": (lambda g: g.set(_P + "expert_gating_func", G.ARRAY, G.Array(G.UINT32, [1])),
                                     ModelLoadError, ["single value"]),
    "no expert count": (lambda g: g.remove(_P + "expert_count"), ModelLoadError, ["needs", "expert_count"]),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_gguf_expert_metadata_refused(family_gguf, tmp_path, case):
    edit, exc, needles = MOE_CASES[case]
    p = _gguf_with(family_gguf("qwen3moe", "f16"), tmp_path, "moe.gguf", edit)
    one_line_error(exc, load_path, p, needles=needles)


def test_gguf_router_with_nan_refused(family_gguf, tmp_path):
    """A router's scores pick the experts: a nan in its weights is refused at load (a few KB,
    scanned), not left to choose experts arbitrarily."""
    from cyllm.loading.gguf import read_gguf
    src = family_gguf("qwen3moe", "f16")
    info = read_gguf(src).tensors["blk.1.ffn_gate_inp.weight"]
    assert info.type_name == "F32"
    buf = bytearray(src.read_bytes())
    struct.pack_into("<f", buf, info.offset + 8, float("nan"))
    p = tmp_path / "nan-router.gguf"
    p.write_bytes(bytes(buf))
    one_line_error(ModelLoadError, load_path, p, needles=["layers.1.mlp.gate", "nan"])


def test_hf_config_of_millions_of_experts_refused_at_once(family_material, tmp_path):
    """num_experts and num_hidden_layers at their bounds (4096 x 4096: 50 M expert tensor names)
    over a checkpoint of 6 experts: the first missing tensor is refused, not after every name
    is listed."""
    d = tmp_path / "moe"
    shutil.copytree(family_material.hf_dir("qwen3moe"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_experts=4096, num_local_experts=4096, num_hidden_layers=4096)
    (d / "config.json").write_text(json.dumps(cfg))
    one_line_error(ModelLoadError, load_path, d, needles=["missing tensor"], seconds=10)


@pytest.mark.parametrize("change,needles", [
    (dict(num_local_experts=4096), ["router.layer.weight", "has shape", "expected (4096, 96)"]),
    (dict(intermediate_size=65), ["input_linear.weight", "has shape", "expected (6, 130, 96)"]),
    (dict(shared_intermediate_size=64), ["Granite MoE", "shared experts"]),
])
def test_granitemoe_stacked_experts_checked_first(family_material, tmp_path, change, needles):
    """Granite MoE keeps a layer's experts in one tensor a role: a config whose expert count or
    size disagrees with them is refused on the stack's shape, in one line and at once (no
    name made for each of 4096 experts first); shared experts are refused by name."""
    d = tmp_path / "gm"
    shutil.copytree(family_material.hf_dir("granitemoe"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    error = UnsupportedModelError if "shared_intermediate_size" in change else ModelLoadError
    one_line_error(error, load_path, d, needles=needles, seconds=10)


def test_gguf_expert_weights_norm_follows_llama_cpp(family_gguf, tmp_path):
    """llama.cpp fixes whether qwen3moe renormalizes the chosen experts' weights (it does),
    whatever a file's expert_weights_norm says: cyllm reads such a file as llama.cpp runs it."""
    from cyllm.loading.gguf import config_from_gguf, read_gguf
    for value in (G.Raw(b"\x00"), "no"):
        edit = (lambda g, v=value: g.set(_P + "expert_weights_norm", G.BOOL if isinstance(v, G.Raw) else G.STRING, v))
        p = _gguf_with(family_gguf("qwen3moe", "f16"), tmp_path, "norm.gguf", edit)
        assert config_from_gguf(read_gguf(p)).expert_norm is True


def test_glm4_vocabulary_adds_no_bos(family_gguf, tmp_path):
    """llama.cpp gives a glm4 vocabulary no BOS token, whatever tokenizer.ggml.add_bos_token
    says (its llama-vocab.cpp); the same file named llama-bpe adds one."""
    from cyllm.loading.gguf import read_gguf
    from cyllm.loading.gguf_tokenizer import build_tokenizer

    def named(pre):
        def edit(g):
            g.set("tokenizer.ggml.pre", G.STRING, pre)
            g.set("tokenizer.ggml.add_bos_token", G.BOOL, True)
        return build_tokenizer(read_gguf(_gguf_with(family_gguf("glm4", "f32"), tmp_path, f"{pre}.gguf", edit)))
    assert not named("glm4").add_bos
    assert named("llama-bpe").add_bos


def test_gguf_sliding_pattern_of_nested_arrays_refused():
    """A sliding_window_pattern of arrays (a GGUF array of arrays) is one clear error, not
    numpy's ambiguous truth value nor a one-element array taken as a flag."""
    import numpy as np
    from cyllm.families import _gguf_sliding
    for flags in ([np.array([0, 1])] * 2, [np.array([1])] * 2, [1.0, 0]):
        with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
            _gguf_sliding({"x.attention.sliding_window_pattern": flags}, "x.", 2, 2)
    assert _gguf_sliding({"x.attention.sliding_window_pattern": [True, 0]}, "x.", 2, 2) == ("sliding", "full")


@pytest.mark.parametrize("value", [(G.STRING, "4096"), (G.BOOL, True), (G.INT32, -5)])
def test_gguf_sliding_window_of_the_wrong_kind_refused(family_gguf, tmp_path, value):
    """Phi-3's (and Mistral's, Mixtral's) window read the one checked way: a string, a flag or
    a negative number is one clear error, not a model run without a window."""
    p = _gguf_with(family_gguf("phi3", "f32"), tmp_path, "w.gguf",
                   lambda g: g.set("phi3.attention.sliding_window", *value))
    one_line_error(ModelLoadError, load_path, p, needles=["sliding_window"])
