"""Fuzzing the files and flags a hostile user hands to cyllm's command line.

Seeds are real files: a tiny Hugging Face directory (tests/tinymodels.py) and a
tiny GGUF (tests/test_gguf.py's write_tiny_gguf). Hypothesis draws structured
mutations of them (a config value of the wrong type or range, a JSON nested
50,000 deep, a safetensors header entry, a GGUF metadata value of another type,
a tensor record, a hostile chat template, command-line flags), every case is
written to disk, and one worker process (tests/fuzz_worker.py) runs
``cyllm generate`` on each (or perplexity, quantize and convert on hostile files and
output paths) under an address-space limit and a time limit.

Each case must end with exit status 0, or 2 and one line ``cyllm: error: ...``;
never a traceback, a signal, more than CASE_SECONDS or more than MEM_MB.
Hypothesis runs derandomized with no example database: CI sees the same cases
on every run, and a failure names the case (its description and files) to replay.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import struct
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gguf_raw as G  # noqa: E402
from hostile import problem, run_batch  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = 150         # per target: ~0.01-0.1 s a case; the module runs in about a minute or two


def _collect(strategy, n: int = EXAMPLES) -> list:
    """``n`` derandomized draws of ``strategy`` (generation only: nothing fails here to shrink)."""
    out = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(x):
        out.append(x)

    draw()
    return out


def _assert_all_clean(cases: list[tuple[list[str], str]], tmp_path: Path, **kw) -> None:
    results = run_batch([argv for argv, _ in cases], tmp_path, **kw)
    bad = []
    for (argv, what), r in zip(cases, results):
        p = problem(r["code"], r["stderr"])
        if p:
            bad.append(f"{what}: {p} (exit {r['code']}; argv {argv}):\n{r['stderr'][-1500:]}")
    assert not bad, f"{len(bad)} of {len(cases)} cases broke the promise:\n\n" + "\n\n".join(bad[:8])


# ============================================================================ values

HUGE_INTS = [0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63, 10 ** 7, 10 ** 12, 10 ** 30]
scalars = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from(HUGE_INTS), st.integers(-2 ** 70, 2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-300, 1e300, float("nan"), float("inf"), -float("inf")]),
    st.text(max_size=12), st.sampled_from(["", "1e4", "true", "a\nb", "\x1b[2J", "\u2028", "\ud800"]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)

CONFIG_KEYS = ["architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
               "tie_word_embeddings", "attention_bias", "sliding_window", "use_sliding_window", "layer_types",
               "bos_token_id", "eos_token_id", "partial_rotary_factor", "original_max_position_embeddings",
               "no_rope_layers", "no_rope_layer_interval", "query_pre_attn_scalar", "rope_local_base_freq",
               "sliding_window_pattern", "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
               "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
               "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "clip_qkv"]
ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
         "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
         "Olmo3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
         "GPTNeoXForCausalLM"]
ROPE = st.fixed_dictionaries({"rope_type": st.sampled_from(["linear", "llama3", "longrope", "default", "yarn"])},
                             optional={k: json_values for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                                 "original_max_position_embeddings",
                                                                 "short_factor", "long_factor",
                                                                 "attention_factor", "rope_theta")})
TOKENIZER_KEYS = ["chat_template", "bos_token", "eos_token", "unk_token", "pad_token",
                  "additional_special_tokens", "model_max_length", "add_bos_token"]

# chat templates: fragments that raise, loop, grow or recurse, glued to benign ones
TEMPLATE_PARTS = [
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{{ bos_token }}", "{% if add_generation_prompt %}assistant:{% endif %}",
    "{{ 1/0 }}", "{{ 1 // 0 }}", "{{ raise_exception('bad\ntemplate') }}", "{{ undefined_thing.x.y }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ range(10**6) | list }}", "{{ lipsum(10**7) }}", "{{ 'x' * 10**10 }}", "{{ [0] * 10**9 }}",
    "{{ 2 ** 10 ** 6 }}", "{{ '%999999999d' % 1 }}", "{{ '{:>999999999}'.format(1) }}",
    "{{ 'x' | center(10**9) }}", "{{ ('x' * 60000) | replace('', 'y' * 60000) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}",
    "{{ messages | tojson(indent=10**9) }}", "{% include 'other' %}", "{{ ''.__class__.__mro__ }}",
    "{% for %}", "{{ (((((((((( 1 )))))))))) }}", "{{ '(' * 100000 }}",
]
templates = st.one_of(st.lists(st.sampled_from(TEMPLATE_PARTS), min_size=1, max_size=4).map("".join),
                      st.text(max_size=60))


# ============================================================================ Hugging Face directories

@pytest.fixture(scope="module")
def hf_seed(tmp_path_factory):
    from tinymodels import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("fuzzseed"), "llama_mqa_odd", dtype="float16")


def _json_edit(data, key, value, delete):
    data = copy.deepcopy(data)
    if key in ("rope_scaling", "rope_theta"):
        data.pop("rope_parameters", None)      # else transformers 5's rope_parameters win
    if delete:
        data.pop(key, None)
    else:
        data[key] = value
    return data


hf_mutations = st.one_of(
    st.tuples(st.just("config.json"), st.sampled_from(CONFIG_KEYS), json_values, st.booleans()),
    st.tuples(st.just("config.json"), st.sampled_from(["rope_scaling", "rope_parameters"]), ROPE, st.just(False)),
    st.tuples(st.just("config.json"), st.just("architectures"),
              st.lists(st.sampled_from(ARCHS), min_size=1, max_size=1), st.just(False)),
    st.tuples(st.sampled_from(["generation_config.json", "tokenizer_config.json"]),
              st.sampled_from(["bos_token_id", "eos_token_id"] + TOKENIZER_KEYS), json_values, st.booleans()),
    st.tuples(st.just("tokenizer_config.json"), st.just("chat_template"), templates, st.just(False)),
    st.tuples(st.sampled_from(["config.json", "tokenizer_config.json", "generation_config.json",
                               "tokenizer.json"]),
              st.sampled_from(["truncate", "deep", "digits", "garbage"]), st.integers(0, 10 ** 6), st.just(None)),
)


def _apply_hf(seed: Path, out: Path, m) -> str:
    shutil.copytree(seed, out)
    fname, key, value, delete = m
    path = out / fname
    if delete is None:        # a raw text edit
        text = path.read_text(encoding="utf-8").rstrip()
        n = value
        if key == "truncate":
            path.write_text(text[:n % (len(text) + 1)], encoding="utf-8")
        elif key == "deep":
            path.write_text(text[:-1] + ', "z": ' + "[" * (n % 60000 + 1) + "]" * (n % 60000 + 1) + "}",
                            encoding="utf-8")
        elif key == "digits":
            path.write_text(text[:-1] + ', "z": ' + "9" * (n % 10000 + 1) + "}", encoding="utf-8")
        else:
            raw = bytearray(path.read_bytes())
            if raw:
                raw[n % len(raw)] ^= 0xFF
            path.write_bytes(bytes(raw))
        return f"{fname}: {key} {n}"
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(_json_edit(data, key, value, delete)), encoding="utf-8")
    return f"{fname}: {'delete ' + key if delete else key + ' = ' + repr(value)[:200]}"


def test_fuzz_hf_configs(hf_seed, tmp_path):
    cases = []
    for i, m in enumerate(_collect(hf_mutations)):
        d = tmp_path / f"hf{i}"
        what = _apply_hf(hf_seed, d, m)
        argv = ["generate", "-m", str(d), "-p", "Hello", "-n", "2", "--temp", "0", "--no-stats"]
        if i % 2:
            argv.append("--chat-template")
        cases.append((argv, what))
    _assert_all_clean(cases, tmp_path, template_seconds=1.0)


# ============================================================================ safetensors

st_mutations = st.one_of(
    st.tuples(st.just("entry"), st.sampled_from(["dtype", "shape", "data_offsets"]), json_values),
    st.tuples(st.just("header_len"), st.integers(0, 2 ** 64 - 1), st.none()),
    st.tuples(st.just("truncate"), st.integers(0, 10 ** 7), st.none()),
    st.tuples(st.just("flip"), st.integers(0, 10 ** 5), st.none()),
    st.tuples(st.just("pad"), st.integers(1, 15), st.none()),       # valid: header length not a multiple of 8
)


def _apply_st(seed: Path, out: Path, m) -> str:
    shutil.copytree(seed, out)
    path = out / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    op, a, b = m
    if op == "entry":
        name = sorted(k for k in header if k != "__metadata__")[len(str(b)) % (len(header) - 1)]
        header[name][a] = b
        h = json.dumps(header).encode()
        raw = struct.pack("<Q", len(h)) + h + data
    elif op == "header_len":
        raw = struct.pack("<Q", a) + raw[8:]
    elif op == "truncate":
        raw = raw[:a % (len(raw) + 1)]
    elif op == "flip":
        i = a % (8 + n)
        raw = raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:]
    else:
        h = json.dumps(header).encode() + b" " * a
        raw = struct.pack("<Q", len(h)) + h + data
    path.write_bytes(raw)
    return f"model.safetensors: {op} {a!r} {b!r}"[:300]


def test_fuzz_safetensors(hf_seed, tmp_path):
    cases = []
    for i, m in enumerate(_collect(st_mutations, EXAMPLES // 2)):
        d = tmp_path / f"st{i}"
        what = _apply_st(hf_seed, d, m)
        cases.append((["generate", "-m", str(d), "-p", "Hello", "-n", "2", "--temp", "0", "--no-stats"], what))
    _assert_all_clean(cases, tmp_path, template_seconds=1.0)


# ============================================================================ GGUF

@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory):
    from test_gguf import write_tiny_gguf
    p = tmp_path_factory.mktemp("fuzzgguf") / "seed.gguf"
    write_tiny_gguf(p)
    g = G.RawGGUF.parse(p.read_bytes())
    g.set("tokenizer.chat_template", G.STRING, TEMPLATE_PARTS[0] + TEMPLATE_PARTS[2])
    return g


GGUF_KEYS = ["general.architecture", "general.alignment", "general.name", "llama.block_count",
             "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.context_length", "llama.attention.layer_norm_rms_epsilon",
             "llama.rope.freq_base", "llama.rope.dimension_count", "llama.rope.scaling.type",
             "llama.rope.scaling.factor", "llama.attention.key_length", "llama.attention.sliding_window",
             "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
             "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
             "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]

_INT_RANGE = {G.UINT8: (0, 255), G.INT8: (-128, 127), G.UINT16: (0, 2 ** 16 - 1), G.INT16: (-2 ** 15, 2 ** 15 - 1),
              G.UINT32: (0, 2 ** 32 - 1), G.INT32: (-2 ** 31, 2 ** 31 - 1), G.UINT64: (0, 2 ** 64 - 1),
              G.INT64: (-2 ** 63, 2 ** 63 - 1)}


def _scalar(t):
    if t in _INT_RANGE:
        lo, hi = _INT_RANGE[t]
        return st.one_of(st.integers(lo, hi), st.sampled_from([v for v in HUGE_INTS if lo <= v <= hi]))
    if t in (G.FLOAT32, G.FLOAT64):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if t == G.FLOAT32 else 64)
    if t == G.BOOL:
        return st.booleans()
    return st.one_of(st.text(max_size=20), templates)


gguf_typed_values = st.one_of(
    st.sampled_from(list(_INT_RANGE) + [G.FLOAT32, G.FLOAT64, G.BOOL, G.STRING]).flatmap(
        lambda t: st.tuples(st.just(t), _scalar(t))),
    st.sampled_from(list(_INT_RANGE) + [G.FLOAT32, G.BOOL, G.STRING]).flatmap(
        lambda t: st.tuples(st.just(G.ARRAY), st.lists(_scalar(t), max_size=6).map(lambda xs, t=t: G.Array(t, xs)))),
    st.integers(2, 100000).map(lambda d: (G.ARRAY, G.nested_array(d))),
)

gguf_mutations = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(GGUF_KEYS), gguf_typed_values),
    st.tuples(st.just("remove"), st.sampled_from(GGUF_KEYS), st.none()),
    st.tuples(st.just("token"), st.integers(0, 600), st.one_of(st.text(max_size=30),
                                                               st.integers(1, 10 ** 6).map(lambda n: "a" * n))),
    st.tuples(st.just("tensor"), st.integers(0, 20),
              st.tuples(st.sampled_from(["dims", "type", "offset", "name"]),
                        st.one_of(st.lists(st.sampled_from([0, 1, 32, 256, 2 ** 32, 2 ** 63]), max_size=5),
                                  st.integers(0, 2 ** 64 - 1), st.text(max_size=20)))),
    st.tuples(st.just("version"), st.integers(0, 2 ** 32 - 1), st.none()),
    st.tuples(st.just("relayout"), st.sampled_from([1, 2, 4, 8, 64, 4096]), st.none()),   # valid files
    st.tuples(st.just("truncate"), st.integers(0, 2 * 10 ** 6), st.none()),
)


def _apply_gguf(seed: G.RawGGUF, m) -> tuple[bytes, str]:
    g = copy.deepcopy(seed)
    op, a, b = m
    if op == "set":
        g.set(a, b[0], b[1])
    elif op == "remove":
        g.remove(a)
    elif op == "token":
        toks = g.get("tokenizer.ggml.tokens")
        toks.items[a % len(toks.items)] = b
    elif op == "tensor":
        row = g.tensors[a % len(g.tensors)]
        field, v = b
        if field == "dims" and isinstance(v, list):
            row[1] = v
        elif field == "type" and isinstance(v, int):
            row[2] = v % 2 ** 32
        elif field == "offset" and isinstance(v, int):
            row[3] = v
        elif field == "name":
            row[0] = str(v)
    elif op == "version":
        g.version = a
    elif op == "relayout":
        G.relayout(g, a)
    raw = g.to_bytes()
    if op == "truncate":
        raw = raw[:a % (len(raw) + 1)]
    return raw, f"gguf: {op} {a!r} {repr(b)[:200]}"


def test_fuzz_gguf(gguf_seed, tmp_path):
    cases = []
    for i, m in enumerate(_collect(gguf_mutations, 2 * EXAMPLES)):
        raw, what = _apply_gguf(gguf_seed, m)
        p = tmp_path / f"case{i}.gguf"
        p.write_bytes(raw)
        argv = ["generate", "-m", str(p), "-p", "Hello", "-n", "2", "--temp", "0", "--no-stats"]
        if i % 3 == 0:
            argv.append("--chat-template")
        cases.append((argv, what))
    _assert_all_clean(cases, tmp_path, template_seconds=1.0)


# ============================================================================ chat templates on the command line

def test_fuzz_chat_template_files(hf_seed, tmp_path):
    cases = []
    for i, source in enumerate(_collect(templates, EXAMPLES // 2)):
        f = tmp_path / f"t{i}.jinja"
        f.write_text(source, encoding="utf-8")
        cases.append((["generate", "-m", str(hf_seed), "-p", "Hello", "-n", "2", "--temp", "0", "--no-stats",
                       "--chat-template", str(f)], f"--chat-template {source[:200]!r}"))
    _assert_all_clean(cases, tmp_path, template_seconds=1.0)


# ============================================================================ command-line flags

FLAG_VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "2", "10", "4096", "100000000", "1" + "0" * 30,
                                         "1e3", "nan", "inf", "-inf", "1e-40", "0.5", "", "abc", "0x10",
                                         "1,2", "1-3", "-", "\n"]),
                        st.integers(-10 ** 12, 10 ** 12).map(str))
GENERATE_FLAGS = ["-n", "-c", "-t", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed",
                  "--threads-batch", "--backend"]
BENCH_FLAGS = ["-p", "-n", "-d", "-t", "-r", "-c", "--backend"]

flag_sets = st.one_of(
    st.tuples(st.just("generate"), st.lists(st.tuples(st.sampled_from(GENERATE_FLAGS), FLAG_VALUES), max_size=3)),
    st.tuples(st.just("bench"), st.lists(st.tuples(st.sampled_from(BENCH_FLAGS), FLAG_VALUES), max_size=3)),
)


def test_fuzz_cli_flags(hf_seed, tmp_path):
    cases = []
    for cmd, flags in _collect(flag_sets):
        argv = [cmd, "-m", str(hf_seed)]
        if cmd == "generate":
            argv += ["-p", "Hello", "--no-stats"]
        else:
            argv += ["-r", "1", "--no-progress"]
        for f, v in flags:
            argv += [f, v]
        if cmd == "generate" and not any(f == "-n" for f, _ in flags):
            argv += ["-n", "4"]
        cases.append((argv, "flags " + " ".join(argv[3:])))
    _assert_all_clean(cases, tmp_path, template_seconds=1.0)


# ============================================================================ the commands that read and write files

# what perplexity reads and what quantize and convert write to: only paths under the test's
# own directory (a regression must not clobber a system file), among them the kinds that broke
# them -- a named pipe as the output of quantize was replaced by a regular file, as was
# /dev/null when run as root
TEXTS = {"empty": b"", "one": b"a", "binary": bytes(range(256)) * 40, "nul": b"hello\x00world " * 400,
         "bad-utf8": b"\xff\xfe\xfa" * 1000, "long-line": b"x" * 200_000,
         "text": "the cat sat on the mat; \u00e9t\u00e9 \u2028 ".encode() * 300}
QUANT_TYPES = ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "Q4_K_M", "q4_k", "f16", "", "iq4_xs"]

file_commands = st.one_of(
    st.tuples(st.just("perplexity"), st.sampled_from(["hf", "gguf", "text"]),
              st.sampled_from(sorted(TEXTS) + ["dir", "missing"]),
              st.lists(st.tuples(st.sampled_from(["-c", "-t", "-tb", "--quantize"]),
                                 st.one_of(FLAG_VALUES, st.sampled_from(QUANT_TYPES))), max_size=2)),
    st.tuples(st.just("quantize"), st.sampled_from(["hf", "gguf", "text", "missing", "dir"]),
              st.sampled_from(["new", "pipe", "dir", "no-parent", "input", "existing"]),
              st.tuples(st.sampled_from(QUANT_TYPES), st.booleans(), st.one_of(st.none(), FLAG_VALUES))),
    st.tuples(st.just("convert"), st.sampled_from(["gguf", "hf", "text", "missing"]),
              st.sampled_from(["new", "pipe", "dir-full", "no-parent", "text"]), st.booleans()),
)


def test_fuzz_file_commands(hf_seed, gguf_seed, tmp_path):
    """perplexity, quantize and convert on hostile inputs and outputs: the same promise."""
    gguf_path = tmp_path / "seed.gguf"
    gguf_path.write_bytes(gguf_seed.to_bytes())
    paths = {"hf": str(hf_seed), "gguf": str(gguf_path), "missing": str(tmp_path / "missing")}
    for name, data in TEXTS.items():
        paths[name] = str(tmp_path / f"{name}.txt")
        Path(paths[name]).write_bytes(data)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir-full").mkdir()
    (tmp_path / "dir-full" / "keep.txt").write_text("x")
    paths.update({"dir": str(tmp_path / "dir"), "dir-full": str(tmp_path / "dir-full")})
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    existing = tmp_path / "existing.out"            # --force may replace this one
    existing.write_text("x")
    # every output kind from a good input, then what Hypothesis draws
    grid = [("quantize", src, dst, ("q8_0", True, "1")) for src in ("hf", "gguf")
            for dst in ("new", "pipe", "dir", "dir-full", "no-parent", "input", "existing")]
    cases = []
    for i, (cmd, src, dst, extra) in enumerate(grid + _collect(file_commands)):
        outs = {"new": str(tmp_path / f"out{i}.gguf"), "pipe": str(pipe), "dir": paths["dir"],
                "dir-full": paths["dir-full"], "no-parent": str(tmp_path / "nowhere" / f"o{i}"),
                "input": paths.get(src, paths["missing"]), "existing": str(existing),
                "text": paths["text"]}
        if cmd == "perplexity":
            argv = ["perplexity", "-m", paths[src], "-f", paths[dst], "--no-progress"]
            for f, v in extra:
                argv += [f, v]
        elif cmd == "quantize":
            qtype, force, threads = extra
            argv = ["quantize", "--type", qtype, paths[src], outs[dst]]
            argv += ["--force"] if force else []
            argv += ["-t", threads] if threads is not None else []
        else:
            argv = ["convert", paths[src], outs[dst] if dst != "new" else str(tmp_path / f"conv{i}")]
            argv += ["--force"] if extra else []
        cases.append((argv, " ".join(argv)))
    _assert_all_clean(cases, tmp_path)
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode), "an output replaced the named pipe"
    assert (tmp_path / "dir-full" / "keep.txt").read_text() == "x"
    assert Path(paths["text"]).read_bytes() == TEXTS["text"]


# ============================================================================ the server's request bodies

SERVER_KEYS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty",
               "frequency_penalty", "presence_penalty", "seed", "stop", "stream", "stream_options", "logprobs",
               "top_logprobs", "response_format", "model", "n", "tools", "tool_choice", "parallel_tool_calls",
               "user", "logit_bias", "echo", "suffix"]
HOSTILE_SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                   {"type": "array", "items": {"$ref": "#"}}, {"$ref": "#/definitions/missing"},
                   {"type": "string", "pattern": "(a|b)*c{1000000}"}, {"enum": list(range(100_000))},
                   {"type": "string", "minLength": 10 ** 9}, {"anyOf": [{"type": "null"}] * 1000},
                   {"type": "object", "properties": {str(i): {"type": "string"} for i in range(2000)}},
                   "not a schema", None]
messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "x"]), scalars),
     "content": st.one_of(st.sampled_from(["Hi", "", "x" * 3000]), json_values)},
    optional={"name": json_values, "tool_calls": json_values}), max_size=3)
good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                               "content": st.text(max_size=40)}), min_size=1, max_size=3)
requests = st.tuples(
    st.booleans(),                                                      # chat or text completion
    st.one_of(good_messages, messages, json_values),                    # messages
    st.one_of(st.sampled_from(["Hello", "", [1, 2, 3], [-1], [10 ** 9], ["a", "b"], [[1]]]), json_values),
    st.dictionaries(st.sampled_from(SERVER_KEYS), json_values, max_size=4),
    st.one_of(st.none(), st.sampled_from(HOSTILE_SCHEMAS)))


def test_fuzz_server_requests(hf_seed):
    """Hostile JSON bodies against `cyllm serve` (the app in this process, over the tiny model):
    every answer is 200, or 4xx with an OpenAI error body; never a 500 or a dropped connection,
    never longer than CASE_SECONDS; and the server still answers afterwards."""
    import time
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import cyllm
    from hostile import CASE_SECONDS
    from test_server import start_server
    model = cyllm.load(str(hf_seed), threads=1)
    srv, thread, url = start_server(model)
    bad, ok = [], {True: 0, False: 0}
    try:
        with httpx.Client(timeout=CASE_SECONDS + 30) as c:
            # well-formed requests first (each endpoint answers some), then what Hypothesis draws
            hi = [{"role": "user", "content": "Hi"}]
            grid = [(chat, hi, "Hello", params, schema) for chat in (True, False)
                    for params, schema in (({}, None), ({"stream": True}, None), ({"logprobs": 2}, None),
                                           ({"seed": 1, "temperature": 0.7}, HOSTILE_SCHEMAS[0]))]
            for chat, msgs, prompt, params, schema in grid + _collect(requests):
                body = {"messages": msgs} if chat else {"prompt": prompt}
                body.update(params)
                if schema is not None:
                    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                body.setdefault("max_tokens", 4)
                data = json.dumps(body, allow_nan=True)
                t0 = time.monotonic()
                try:
                    r = c.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), content=data,
                               headers={"content-type": "application/json"})
                    code, text = r.status_code, r.text
                except httpx.HTTPError as e:
                    code, text = "dropped", repr(e)
                seconds = time.monotonic() - t0
                ok[chat] += code == 200
                if code == "dropped" or code >= 500 or seconds > CASE_SECONDS or (
                        code != 200 and '"error"' not in text):
                    bad.append(f"{code} after {seconds:.1f} s: {data[:300]} -> {text[:300]}")
            assert c.get(url + "/health").status_code == 200
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    assert not bad, f"{len(bad)} requests broke the promise:\n" + "\n".join(bad[:8])
    assert ok[True] and ok[False], f"too few requests were answered to test much: {ok}"


def test_server_refuses_bodies_built_to_break_the_parser(hf_seed, monkeypatch):
    """Bodies that broke `cyllm serve`'s JSON parsing with a 500 (nesting past the recursion
    limit, an integer past Python's digit limit) are 400s; a body past the size cap is a 413,
    whether it declares its length or comes chunked; a huge bad value is not echoed whole in
    the error; the server answers normally afterwards."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import cyllm
    import cyllm.tools.server.app as app
    from test_server import start_server
    monkeypatch.setattr(app, "MAX_BODY_BYTES", 1 << 20)
    srv, thread, url = start_server(cyllm.load(str(hf_seed), threads=1))
    hi = b'[{"role": "user", "content": "hi"}]'
    cases = [
        (b"[" * 100_000, 400, "nests 100000 levels"),
        (b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "nests 50001 levels"),
        (b'{"messages": ' + hi + b', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
         b'"schema": ' + b'{"items": ' * 3000 + b"{}" + b"}" * 3000 + b"}}}", 400, "levels deep"),
        (b'{"messages": ' + hi + b', "max_tokens": ' + b"9" * 5000 + b"}", 400, "parse the JSON"),
        (b'"just a string"', 400, "must be a JSON object"),
        (b'{"messages": ' + hi + b', "temperature": "' + b"x" * (512 << 10) + b'"}', 400, "temperature must be"),
        (b'{"messages": ' + hi + b', "' + b"k" * (512 << 10) + b'": 1}', 400, "unsupported parameter"),
        (b'{"messages": ' + hi + b', "user": "' + b"x" * (2 << 20) + b'"}', 413, "larger than 1 MiB"),
    ]
    try:
        with httpx.Client(timeout=60) as c:
            def post(content):
                return c.post(url + "/v1/chat/completions", content=content,
                              headers={"content-type": "application/json"})
            for body, status, words in cases:
                r = post(body)
                assert r.status_code == status and words in r.json()["error"]["message"], (body[:60], r.text[:300])
                assert len(r.content) < 1000, (body[:60], len(r.content))     # a value is not echoed whole
            r = post(iter([b'{"messages": ' + hi + b', "user": "'] + [b"x" * 65536] * 40 + [b'"}']))   # chunked
            assert r.status_code == 413, r.text[:300]
            r = post(b'{"messages": ' + hi + b', "max_tokens": 2}')
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# ============================================================================ the JSON reader, in process

@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(st.one_of(st.text(alphabet='[]{}"\\:,0123456789.eE-+ atrufnlsNIxy\n', max_size=300),
                 json_values.map(json.dumps)))
def test_parse_json_agrees_with_json_or_refuses_in_one_line(text):
    """Whatever parse_json accepts, json.loads reads the same way; the rest is one ModelLoadError line."""
    from cyllm.errors import ModelLoadError
    from cyllm.jsonio import parse_json
    try:
        ours = parse_json(text, "f.json")
    except ModelLoadError as e:
        assert "\n" not in str(e)
        return
    assert json.dumps(ours, sort_keys=True) == json.dumps(json.loads(text), sort_keys=True)
