"""The Llama-family transformer, written once against the backend op interface.

Weights, run state and KV cache are separate plain structures (llama2.c
style); every buffer is allocated here, once, so a token's forward pass only
issues ops into preallocated arrays.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends import get_backend
from .config import ModelConfig
from .errors import ContextFullError, InvalidArgumentError

DEFAULT_CONTEXT = 4096
PREFILL_CHUNK = 256       # prompt tokens per batched pass: weights are read once per chunk
BATCH_OPS = ("embed_batch", "rmsnorm_batch", "matmul", "matmul_add", "gate_up_silu_batch",
             "add_rows", "rope_batch", "cache_store_batch", "attention_batch")


@dataclass
class LayerWeights:
    attn_norm: Any      # (dim,) f32
    wq: Any             # (n_heads*head_dim, dim) f16
    wk: Any             # (n_kv*head_dim, dim) f16
    wv: Any             # (n_kv*head_dim, dim) f16
    bq: Any | None      # (n_heads*head_dim,) f32, Qwen2 only
    bk: Any | None      # (n_kv*head_dim,) f32
    bv: Any | None      # (n_kv*head_dim,) f32
    wo: Any             # (dim, n_heads*head_dim) f16
    ffn_norm: Any       # (dim,) f32
    w_gate: Any         # (ffn, dim) f16
    w_up: Any           # (ffn, dim) f16
    w_down: Any         # (dim, ffn) f16
    k_cache: Any        # (n_kv, context, head_dim) f16
    v_cache: Any        # (n_kv, context, head_dim) f16
    wqkv: Any = None    # (q_dim + 2*kv_dim, dim) f16 when the backend fuses q/k/v (wq/wk/wv are row views)
    bqkv: Any = None    # (q_dim + 2*kv_dim,) f32


@dataclass
class RunState:
    qkv: Any      # (n_heads*head_dim + 2*n_kv*head_dim,) q, k and v side by side
    x: Any        # (dim,) residual stream
    xb: Any       # (dim,) normed input of a sub-block
    q: Any        # (n_heads*head_dim,)  view of qkv
    k: Any        # (n_kv*head_dim,)     view of qkv
    v: Any        # (n_kv*head_dim,)     view of qkv
    att: Any      # (n_heads*head_dim,) attention output, before wo
    hb: Any       # (ffn,) silu(gate) * up
    logits: Any   # (vocab,)


@dataclass
class BatchState:
    """Prefill buffers: row t of each array belongs to prompt token t of the chunk."""
    tokens: np.ndarray   # (B,) int32, host
    x: Any               # (B, dim)
    xb: Any              # (B, dim)
    q: Any               # (B, n_heads*head_dim)
    k: Any               # (B, n_kv*head_dim)
    v: Any               # (B, n_kv*head_dim)
    att: Any             # (B, n_heads*head_dim)
    hb: Any              # (B, ffn)
    logits: Any = None   # (B, vocab), only once logits at every position are asked for


class Model:
    """A loaded model bound to one backend, with its KV cache and tokenizer."""

    def __init__(self, config: ModelConfig, weights: dict, tokenizer=None, backend="cpu",
                 threads=None, context: int | None = None, threads_batch=None):
        from .loading import validate_weights

        validate_weights(config, weights)
        self.config = config
        self.tokenizer = tokenizer
        self.backend = get_backend(backend, threads) if isinstance(backend, str) else backend
        self.context = _resolve_context(config, context)
        self.threads_decode = self.backend.threads
        self.threads_prefill = self.backend.threads
        if threads_batch is not None:
            self.set_threads(self.backend.threads, threads_batch)
        self.weight_bytes = sum(int(a.nbytes) for a in weights.values())
        self.batched_prefill = all(hasattr(self.backend, op) for op in BATCH_OPS)
        self.batch: BatchState | None = None
        self.kv_owner = None                  # the generate.Session whose tokens the KV cache holds
        self.lock = threading.RLock()   # one cache: sessions take turns, one step at a time
        self._build(weights)

    @classmethod
    def from_weights(cls, config, weights, tokenizer=None, backend="cpu", threads=None, context=None,
                     threads_batch=None):
        return cls(config, weights, tokenizer, backend, threads, context, threads_batch)

    # -- construction ---------------------------------------------------------
    def _build(self, w: dict) -> None:
        c, b = self.config, self.backend
        up = b.upload
        self.embedding = up(w["model.embed_tokens.weight"])            # (vocab, dim) f16
        self.final_norm = up(w["model.norm.weight"])                    # (dim,) f32
        if "lm_head.weight" in w and not c.tie_word_embeddings:
            self.output = up(w["lm_head.weight"])                       # (vocab, dim) f16
        else:
            self.output = self.embedding
        self.layers: list[LayerWeights] = []
        fuse = bool(getattr(b, "fuse_qkv", False))
        qd, kd = c.q_dim, c.kv_dim
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            names = [p + f"self_attn.{m}_proj.weight" for m in "qkv"]
            bias_names = [p + f"self_attn.{m}_proj.bias" for m in "qkv"]
            has_bias = c.attention_bias and all(n in w for n in bias_names)
            wqkv = bqkv = None
            if fuse:
                wqkv = up(np.concatenate([w[n] for n in names]))
                wq, wk, wv = wqkv[:qd], wqkv[qd:qd + kd], wqkv[qd + kd:]
                if has_bias:
                    bqkv = up(np.concatenate([w[n] for n in bias_names]))
            else:
                wq, wk, wv = (up(w[n]) for n in names)
            if bqkv is not None:
                bq, bk, bv = bqkv[:qd], bqkv[qd:qd + kd], bqkv[qd + kd:]
            elif has_bias:
                bq, bk, bv = (up(w[n]) for n in bias_names)
            else:
                bq = bk = bv = None
            self.layers.append(LayerWeights(
                attn_norm=up(w[p + "input_layernorm.weight"]),
                wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv,
                wo=up(w[p + "self_attn.o_proj.weight"]),
                ffn_norm=up(w[p + "post_attention_layernorm.weight"]),
                w_gate=up(w[p + "mlp.gate_proj.weight"]),
                w_up=up(w[p + "mlp.up_proj.weight"]),
                w_down=up(w[p + "mlp.down_proj.weight"]),
                k_cache=b.empty((c.n_kv_heads, self.context, c.head_dim), np.float16),
                v_cache=b.empty((c.n_kv_heads, self.context, c.head_dim), np.float16),
                wqkv=wqkv, bqkv=bqkv,
            ))
        cos, sin = c.rope_tables(self.context)                          # (context, head_dim/2)
        self.rope_cos, self.rope_sin = up(cos), up(sin)
        qkv = b.empty((qd + 2 * kd,))
        self.state = RunState(
            qkv=qkv, x=b.empty((c.dim,)), xb=b.empty((c.dim,)), q=qkv[:qd], k=qkv[qd:qd + kd],
            v=qkv[qd + kd:], att=b.empty((qd,)), hb=b.empty((c.ffn_dim,)), logits=b.empty((c.vocab_size,)))

    # -- the forward pass -----------------------------------------------------
    def _issue_forward_ops(self, token: int, pos: int) -> None:
        """Queue every op of one token's forward pass; logits land in state.logits."""
        b, s, c = self.backend, self.state, self.config
        eps = c.norm_eps
        b.embed(s.x, self.embedding, token)
        for L in self.layers:
            # attention block: x += wo @ attention(rope(wq xb), rope(wk xb), wv xb)
            b.rmsnorm(s.xb, s.x, L.attn_norm, eps)
            if L.wqkv is not None:
                b.matvec(s.qkv, L.wqkv, s.xb)
                if L.bqkv is not None:
                    b.add(s.qkv, s.qkv, L.bqkv)
            else:
                b.matvec(s.q, L.wq, s.xb)
                b.matvec(s.k, L.wk, s.xb)
                b.matvec(s.v, L.wv, s.xb)
                if L.bq is not None:
                    b.add(s.q, s.q, L.bq)
                    b.add(s.k, s.k, L.bk)
                    b.add(s.v, s.v, L.bv)
            b.rope_store(s.q, s.k, s.v, self.rope_cos, self.rope_sin, L.k_cache, L.v_cache, pos)
            b.attention(s.att, s.q, L.k_cache, L.v_cache, pos)
            b.matvec_add(s.x, L.wo, s.att)
            # MLP block: x += w_down @ (silu(w_gate xb) * (w_up xb))
            b.rmsnorm(s.xb, s.x, L.ffn_norm, eps)
            b.gate_up_silu(s.hb, L.w_gate, L.w_up, s.xb)
            b.matvec_add(s.x, L.w_down, s.hb)
        b.rmsnorm(s.xb, s.x, self.final_norm, eps)
        b.matvec(s.logits, self.output, s.xb)

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Run one token at position ``pos``; returns logits (vocab,) f32 on the host.

        The returned array is reused by the next call: copy it to keep it.
        """
        self._check_token(token)
        if not 0 <= pos < self.context:
            raise ContextFullError(f"position {pos} is outside the context window of {self.context} tokens")
        step = getattr(self.backend, "decode_step", None)
        if step is not None:
            step(self._issue_forward_ops, token, pos)
        else:
            self._issue_forward_ops(token, pos)
        return self.backend.to_host(self.state.logits)

    def prefill(self, tokens, pos0: int = 0, all_logits: bool = False) -> np.ndarray:
        """Fill the KV cache with ``tokens`` at positions pos0.. .

        Returns the logits of the last token (vocab,), or with ``all_logits``
        those of every token (len(tokens), vocab) in a new array.
        """
        tokens = self._check_ids(tokens)
        if pos0 < 0 or pos0 + len(tokens) > self.context:
            raise ContextFullError(
                f"{len(tokens)} tokens from position {pos0} do not fit in the context window "
                f"of {self.context} tokens")
        out = np.empty((len(tokens), self.config.vocab_size), np.float32) if all_logits else None
        switch = self.threads_prefill != self.threads_decode and len(tokens) > 1
        if switch:
            self.backend.set_threads(self.threads_prefill)
        try:
            if self.batched_prefill and len(tokens) > 1:
                logits = self._prefill_batched(tokens, pos0, out)
            else:
                for i, t in enumerate(tokens):
                    logits = self.forward(t, pos0 + i)
                    if out is not None:
                        out[i] = logits
        finally:
            if switch:
                self.backend.set_threads(self.threads_decode)
        return out if all_logits else logits

    def logits(self, ids) -> np.ndarray:
        """Logits at every position of a fresh sequence: (len(ids), vocab) f32."""
        ids = self._check_ids(ids)
        if len(ids) > self.context:
            raise ContextFullError(f"{len(ids)} tokens do not fit in the context window of {self.context} tokens")
        return self.prefill(ids, 0, all_logits=True)

    # -- batched prefill ------------------------------------------------------
    def _batch_state(self, all_logits: bool) -> BatchState:
        c, b = self.config, self.backend
        if self.batch is None:
            n = min(PREFILL_CHUNK, self.context)
            self.batch = BatchState(
                tokens=np.zeros(n, np.int32), x=b.empty((n, c.dim)), xb=b.empty((n, c.dim)),
                q=b.empty((n, c.q_dim)), k=b.empty((n, c.kv_dim)), v=b.empty((n, c.kv_dim)),
                att=b.empty((n, c.q_dim)), hb=b.empty((n, c.ffn_dim)))
        if all_logits and self.batch.logits is None:
            self.batch.logits = b.empty((self.batch.tokens.shape[0], c.vocab_size))
        return self.batch

    def _prefill_batched(self, tokens: list[int], pos0: int, out: np.ndarray | None) -> np.ndarray:
        B = self._batch_state(out is not None)
        chunk = B.tokens.shape[0]
        logits = None
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            last = start + chunk >= len(tokens)
            B.tokens[:len(part)] = part
            self._issue_batch_ops(len(part), pos0 + start, all_logits=out is not None)
            if out is not None:
                out[start:start + len(part)] = self.backend.to_host(B.logits)[:len(part)]
            elif last:
                logits = self.backend.to_host(self.state.logits)
        return out[-1] if out is not None else logits

    def _issue_batch_ops(self, T: int, pos0: int, all_logits: bool) -> None:
        """The forward pass of ``_issue_forward_ops`` for T prompt tokens at once."""
        b, c, s, B = self.backend, self.config, self.state, self.batch
        eps = c.norm_eps
        x, xb, q, k, v = B.x[:T], B.xb[:T], B.q[:T], B.k[:T], B.v[:T]
        att, hb = B.att[:T], B.hb[:T]
        b.embed_batch(x, self.embedding, B.tokens[:T])
        for L in self.layers:
            b.rmsnorm_batch(xb, x, L.attn_norm, eps)
            b.matmul(q, L.wq, xb)
            b.matmul(k, L.wk, xb)
            b.matmul(v, L.wv, xb)
            if L.bq is not None:
                b.add_rows(q, q, L.bq)
                b.add_rows(k, k, L.bk)
                b.add_rows(v, v, L.bv)
            b.rope_batch(q, k, self.rope_cos, self.rope_sin, pos0)
            b.cache_store_batch(L.k_cache, L.v_cache, k, v, pos0)
            b.attention_batch(att, q, L.k_cache, L.v_cache, pos0)
            b.matmul_add(x, L.wo, att)
            b.rmsnorm_batch(xb, x, L.ffn_norm, eps)
            b.gate_up_silu_batch(hb, L.w_gate, L.w_up, xb)
            b.matmul_add(x, L.w_down, hb)
        if all_logits:
            b.rmsnorm_batch(xb, x, self.final_norm, eps)
            b.matmul(B.logits[:T], self.output, xb)
        else:   # only the last position's logits are needed
            b.rmsnorm(s.xb, B.x[T - 1], self.final_norm, eps)
            b.matvec(s.logits, self.output, s.xb)

    # -- generation (the loop lives in generate.py) ---------------------------
    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float | None = None,
                 seed: int | None = None, stop=None, *, repetition_penalty: float | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_last_n: int = 64,
                 session=None, stats=None, add_special_tokens: bool = True):
        """Stream generated text pieces for ``prompt`` (a string or token ids).

        Greedy by default (temperature 0). ``stop``: one string or a list of
        strings. ``repeat_penalty`` (llama.cpp's name) = ``repetition_penalty``.
        See generate.generate.
        """
        from .generate import generate
        return generate(self, prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                        repeat_penalty=repeat_penalty, seed=seed, stop=stop, session=session, stats=stats,
                        add_special_tokens=add_special_tokens, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, repeat_last_n=repeat_last_n)

    def create_completion(self, prompt, **kwargs):
        """OpenAI-shaped text completion (a dict, or an iterator of chunks with stream=True);
        see cyllm.completions.create_completion for the options."""
        from .completions import create_completion
        return create_completion(self, prompt, **kwargs)

    def create_chat_completion(self, messages, **kwargs):
        """OpenAI-shaped chat completion (a dict, or an iterator of chunks with stream=True);
        see cyllm.completions.create_chat_completion for the options."""
        from .completions import create_chat_completion
        return create_chat_completion(self, messages, **kwargs)

    def set_threads(self, decode, prefill=None) -> None:
        """Kernel threads for decoding, and optionally a different count for prefill."""
        from .threads import parse_threads
        if not hasattr(self.backend, "set_threads"):
            return
        self.threads_decode = parse_threads(decode)
        self.threads_prefill = parse_threads(prefill, "threads-batch") if prefill is not None else self.threads_decode
        self.backend.set_threads(self.threads_decode)

    # -- argument checks -------------------------------------------------------
    def _check_token(self, token) -> None:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise InvalidArgumentError(f"token ids must be integers, got {token!r}")
        if not 0 <= token < self.config.vocab_size:
            raise InvalidArgumentError(f"token id {token} is out of range [0, {self.config.vocab_size})")

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        ids = list(ids)
        if not ids:
            raise InvalidArgumentError("an empty list of token ids was given")
        for t in ids:
            self._check_token(t)
        return [int(t) for t in ids]

    def __repr__(self) -> str:
        c = self.config
        return (f"<cyllm.Model {c.name or c.arch}: {c.n_params / 1e6:.1f}M params, "
                f"{self.weight_bytes / 1e6:.0f} MB, backend={self.backend.name}"
                f"/{self.backend.kernel_variant}, threads={self.backend.threads}, context={self.context}>")


def _resolve_context(config: ModelConfig, context) -> int:
    if context is None:
        return min(config.max_seq_len, DEFAULT_CONTEXT)
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context <= 0:
        raise InvalidArgumentError(f"context must be a positive integer, got {context!r}")
    return int(context)
