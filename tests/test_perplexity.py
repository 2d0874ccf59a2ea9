"""perplexity(): llama.cpp's method, checked against an independent transformers computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cyllm.errors import InvalidArgumentError
from cyllm.tools.perplexity import format_ppl, perplexity
from conftest import HOST_BACKENDS

TEXT = (
    "The history of the city begins with a small settlement on the bank of a slow river. "
    "Farmers came first, drawn by the rich soil and the mild winters, and they built their "
    "houses of wood and clay along the water. Over the years a market grew at the crossing, "
    "where traders from the hills brought wool and salt to exchange for grain and fish. "
    "By the time the first stone bridge was built, the village had become a town with a "
    "church, a school and a town hall where the council met every week to settle disputes. "
    "In the nineteenth century the railway arrived, and with it came factories, workers and "
    "a great deal of smoke. The population doubled in twenty years. New streets were laid "
    "out in straight lines to the north of the old center, and rows of brick houses filled "
    "the fields where cattle had grazed. Children who had once worked on farms now worked in "
    "the mills, and many families lived in crowded rooms without clean water. Reformers wrote "
    "letters to the newspapers and gave speeches in the square, and slowly the town began to "
    "change. A water works was opened, then a hospital, then a public library with a reading "
    "room that stayed open until nine in the evening. "
    "Today the factories are gone, but many of their buildings remain. Some have been turned "
    "into apartments, others into offices, shops and a museum that tells the story of the "
    "workers who once filled them. The river is clean again, and on summer evenings people "
    "walk along its banks, watching the boats and the birds. Visitors come to see the old "
    "bridge, the market hall and the gardens behind the church, which are said to be the "
    "oldest in the region. The town council still meets every week, although the disputes it "
    "settles are now about parking, noise and the price of tickets for the summer festival. "
    "Every year in June the festival fills the streets with music, food and dancing, and for "
    "three days the whole town seems to remember that it was once a small village where "
    "everyone knew everyone else. "
)

CTX = 64


def pick_backend() -> str:
    return HOST_BACKENDS[-1]      # the compiled cpu backend when built, else the numpy reference


# ============================================================================ unit checks (no model)

class StubTokenizer:
    def __init__(self, add_bos, bos_id=0):
        self.add_bos, self.bos_id = add_bos, bos_id

    def encode(self, text, add_special_tokens=True):
        ids = [1 + (ord(ch) % 7) for ch in text]
        return ([self.bos_id] if add_special_tokens and self.add_bos else []) + ids


class StubModel:
    """Logits that put probability p on the token (t+1) % V after t: a known answer."""

    def __init__(self, add_bos=False, vocab=8):
        self.tokenizer = StubTokenizer(add_bos)
        self.context = 4096
        self.vocab = vocab
        self.seen = []

    def logits(self, ids):
        self.seen.append(list(ids))
        out = np.zeros((len(ids), self.vocab), np.float32)
        for i, t in enumerate(ids):
            out[i, (t + 1) % self.vocab] = 2.0
        return out


def test_method_on_stub():
    m = StubModel(add_bos=False)
    text = "abcdefghij" * 10                     # 100 tokens
    ppl, err = perplexity(m, text, 16, progress=False)
    toks = m.tokenizer.encode(text)
    assert len(m.seen) == 100 // 16
    nll = []
    for c in range(100 // 16):
        chunk = toks[c * 16:(c + 1) * 16]
        for pos in range(8, 15):                  # logits at first..ctx-2 predict first+1..ctx-1
            lg = np.zeros(8)
            lg[(chunk[pos] + 1) % 8] = 2.0
            nll.append(np.log(np.exp(lg).sum()) - lg[chunk[pos + 1]])
    nll = np.array(nll)
    assert ppl == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    want_err = math.sqrt(((nll ** 2).mean() - nll.mean() ** 2) / (len(nll) - 1)) * ppl
    assert err == pytest.approx(want_err, rel=1e-9)


def test_bos_replaces_first_token_of_each_chunk():
    m = StubModel(add_bos=True)
    text = "abcdefg" * 10
    perplexity(m, text, 16, progress=False)
    toks = m.tokenizer.encode(text)
    assert toks[0] == 0
    for i, chunk in enumerate(m.seen):
        assert chunk[0] == 0 and chunk[1:] == toks[i * 16 + 1:(i + 1) * 16]


def test_errors():
    m = StubModel()
    with pytest.raises(InvalidArgumentError, match="empty"):
        perplexity(m, "", 16, progress=False)
    with pytest.raises(InvalidArgumentError, match="empty"):
        perplexity(m, "  \n ", 16, progress=False)
    with pytest.raises(InvalidArgumentError, match="too short"):
        perplexity(m, "a" * 31, 16, progress=False)        # 31 tokens < 2 chunks of 16
    with pytest.raises(InvalidArgumentError):
        perplexity(m, "a" * 100, 1, progress=False)
    m.context = 32
    with pytest.raises(InvalidArgumentError, match="context"):
        perplexity(m, "a" * 1000, 64, progress=False)


def test_format():
    assert format_ppl(12.345678, 0.1234567) == "PPL = 12.3457 +/- 0.12346"


# ============================================================================ the real model

@pytest.fixture(scope="module")
def real_path():
    from cyllm.default_model import default_model_path
    return default_model_path()


def test_real_model_against_transformers(real_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import cyllm

    model = cyllm.load(real_path, backend=pick_backend(), context=CTX)
    ppl, err = perplexity(model, TEXT, CTX, progress=True)
    assert capsys.readouterr().err == ""         # stderr is not a terminal here: no progress bar

    # independent reference: transformers' tokenizer and model, numpy NLL over second halves
    tok = transformers.AutoTokenizer.from_pretrained(str(real_path.parent), gguf_file=real_path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_path.parent), gguf_file=real_path.name, dtype=torch.float32)
    ids = tok(TEXT)["input_ids"]            # this tokenizer adds no BOS (add_bos_token false)
    n = len(ids) // CTX
    assert n >= 2
    nll = []
    for c in range(n):
        chunk = ids[c * CTX:(c + 1) * CTX]
        with torch.no_grad():
            lg = ref(torch.tensor([chunk])).logits[0].double().numpy()
        lp = lg - lg.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        for pos in range(CTX // 2, CTX - 1):
            nll.append(-lp[pos, chunk[pos + 1]])
    nll = np.array(nll)
    ref_ppl = math.exp(nll.mean())
    ref_err = math.sqrt(nll.var() / (len(nll) - 1)) * ref_ppl
    assert abs(ppl - ref_ppl) / ref_ppl < 0.01, (ppl, ref_ppl)
    assert abs(err - ref_err) / ref_err < 0.05, (err, ref_err)
    assert 1.0 < ppl < 100.0


def test_real_model_short_text(real_path):
    import cyllm
    model = cyllm.load(real_path, backend="numpy", context=CTX)
    with pytest.raises(InvalidArgumentError, match="too short"):
        perplexity(model, "Just a few words.", CTX, progress=False)
    with pytest.raises(InvalidArgumentError, match="empty"):
        perplexity(model, "", CTX, progress=False)
