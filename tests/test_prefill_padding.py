"""Prompt chunks run at more rows than they hold (Backend.prefill_rows: the cuda backend pads a
short chunk to a length it keeps a graph for) give the logits of the unpadded chunks.

The padding is forced on a host backend here, to the whole chunk (the most it may pad), and
the padded model is held against the same model unpadded: the last token's logits come from
the last real row, every row's logits from the real rows, and the cache rows the padding
wrote past the prompt do not reach the tokens decoded after it.
"""

import numpy as np
import pytest

import cyllm
from conftest import HOST_BACKENDS
from tinymodels import make_tiny_model

CHUNK = 16


def rel_err(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pad"), "mistral_gqa", seed=11)


def _load(path, backend, padded: bool, seen: list):
    model = cyllm.load(path, backend=backend)
    model.backend.prefill_chunk = CHUNK
    model.batch = None

    def rows(t, most):
        seen.append((t, most))
        return most if padded else t
    model.backend.prefill_rows = rows
    return model


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_padded_chunks_give_the_unpadded_logits(path, backend):
    seen_p, seen_u = [], []
    padded = _load(path, backend, True, seen_p)
    plain = _load(path, backend, False, seen_u)
    ids = np.random.default_rng(3).integers(3, padded.config.vocab_size - 3, 45).tolist()
    # each prompt goes on from positions the one before left valid (a cache row past a prompt
    # holds nothing a caller may read: the pad rows are written there)
    for n, pos0 in ((45, 0), (7, 3), (20, 10)):         # chunks of 16+16+13, 7, 16+4
        part = ids[:n]
        assert rel_err(padded.prefill(part, pos0), plain.prefill(part, pos0)) < 1e-5
        assert rel_err(padded.prefill(part, pos0, all_logits=True),
                       plain.prefill(part, pos0, all_logits=True)) < 1e-5
    # the room left in the cache bounds the padding: the last chunk ends at the context's end
    end = padded.context - 5
    history = (ids * (end // len(ids) + 1))[:end]
    for m in (padded, plain):
        m.prefill(history, 0)
    np.testing.assert_allclose(padded.prefill(ids[:5], end), plain.prefill(ids[:5], end), rtol=0, atol=1e-5)
    assert seen_p[-1] == (5, 5) and (13, CHUNK) in seen_p and seen_p == seen_u
    # decoding after a padded prompt: the pad rows' cache entries (positions 20..31 here) are
    # overwritten by each token before its attention reads them
    padded.prefill(ids[:20], 0)
    plain.prefill(ids[:20], 0)
    for pos in range(20, 34):
        tok = ids[pos % len(ids)]
        assert rel_err(padded.forward(tok, pos), plain.forward(tok, pos)) < 1e-5


def test_cuda_padding_lengths():
    """The cuda backend's padding (no GPU needed): every chunk of 1..512 tokens runs at one of
    ten lengths, each captured the first time it comes (padded_length), never past the room
    left in the cache, at most 63 rows over past 64; no padding where no graph would replay."""
    from types import SimpleNamespace

    from cyllm.backends.cuda.prefill_graph import MAX_PREFILL_GRAPHS, GraphPrefill, padded_length
    be = SimpleNamespace(use_graphs=True, prefill_graphs=True, data_dependent_prefill=False, _prefill_never=set())
    rows = {t: GraphPrefill.prefill_rows(be, t, 512) for t in range(1, 513)}
    lengths = sorted(set(rows.values()))
    assert lengths == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512] and len(lengths) <= MAX_PREFILL_GRAPHS
    assert all(padded_length(r) for r in lengths)
    assert all(t <= r and (r <= 64 or r - t < 64) for t, r in rows.items())
    assert not any(padded_length(n) for n in (1, 8, 15, 48, 65, 100, 500))
    assert GraphPrefill.prefill_rows(be, 70, 100) == 100 and GraphPrefill.prefill_rows(be, 5, 9) == 9
    for off in (dict(use_graphs=False), dict(prefill_graphs=False), dict(_prefill_never={"a key"}),
                dict(data_dependent_prefill=True)):
        assert GraphPrefill.prefill_rows(SimpleNamespace(**{**vars(be), **off}), 13, 512) == 13
