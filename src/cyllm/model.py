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
from .config import MAX_CONTEXT, ModelConfig
from .families import family
from .backends.moe import MoeScratch
from .errors import ContextFullError, InvalidArgumentError, ModelLoadError, UnsupportedModelError
from .memory import check_model_fits
from .oneline import one_line
from .quant.matrix import QuantMatrix

DEFAULT_CONTEXT = 4096
QKV = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
EXPERT_ROLES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@dataclass
class Layer:
    """One block's weights (backend arrays), its KV cache and its attention settings."""
    # matrices: float16 backend arrays or QuantMatrix (blocks of a quantized format), see loading
    attn_norm: Any                # (dim,) f32; None: the block reads the stream as it is (OLMo 2)
    wq: Any                       # (n_heads*head_dim, dim) f16 (a row view of wqkv when fused)
    wk: Any                       # (n_kv*head_dim, dim) f16
    wv: Any                       # (n_kv*head_dim, dim) f16
    wo: Any                       # (dim, n_heads*head_dim) f16
    ffn_norm: Any                 # (dim,) f32; None as attn_norm
    w_gate: Any                   # (ffn, dim) f16; None in a mixture of experts
    w_up: Any                     # (ffn, dim) f16
    w_down: Any                   # (dim, ffn) f16
    k_cache: Any                  # (n_kv, context, head_dim) f16
    v_cache: Any                  # (n_kv, context, head_dim) f16
    window: int = 0               # attention sees the last `window` positions (0: all)
    rope: tuple | None = None     # (cos, sin) tables (context, rot/2) f32; None: no rope (NoPE)
    wqkv: Any = None              # (q_dim + 2*kv_dim, dim) f16: q, k, v in one matvec
    bq: Any = None                # (n_heads*head_dim,) f32 biases (Qwen2)
    bk: Any = None
    bv: Any = None
    bqkv: Any = None              # (q_dim + 2*kv_dim,) f32 when wqkv is used
    q_norm: Any = None            # (head_dim,) f32 per-head norms (Qwen3, Gemma 3); (q_dim,) whole (OLMo 2)
    k_norm: Any = None
    post_attn_norm: Any = None    # (dim,) f32 norms of the block outputs (Gemma 3)
    post_ffn_norm: Any = None
    router: Any = None            # (n_experts, dim) f32: a mixture of experts' router, else None
    experts: tuple | None = None  # n_experts (w_gate (ffn, dim), w_up, w_down (dim, ffn)) of its MLP


@dataclass
class RunState:
    """Decode buffers (one token)."""
    qkv: Any      # (q_dim + 2*kv_dim,) q, k and v side by side
    x: Any        # (dim,) residual stream
    xb: Any       # (dim,) normed input of a sub-block
    tmp: Any      # (dim,) a block's output before its post-norm
    q: Any        # (n_heads*head_dim,)  view of qkv
    k: Any        # (n_kv*head_dim,)     view of qkv
    v: Any        # (n_kv*head_dim,)     view of qkv
    q_heads: Any  # (n_heads, head_dim)  view of q, for per-head norms
    k_heads: Any  # (n_kv, head_dim)     view of k
    att: Any      # (n_heads*head_dim,) attention output, before wo
    hb: Any       # (ffn,) act(gate) * up
    logits: Any   # (vocab,)
    moe: MoeScratch | None = None   # a mixture of experts' work arrays


@dataclass
class BatchState:
    """Prefill buffers: row t of each array belongs to prompt token t of the chunk."""
    tokens: np.ndarray   # (B,) int32, host
    x: Any               # (B, dim)
    xb: Any              # (B, dim)
    tmp: Any             # (B, dim)
    q: Any               # (B, n_heads*head_dim)
    k: Any               # (B, n_kv*head_dim)
    v: Any               # (B, n_kv*head_dim)
    att: Any             # (B, n_heads*head_dim)
    hb: Any              # (B, ffn)
    logits: Any = None   # (B, vocab), only once logits at every position are asked for
    moe: MoeScratch | None = None   # a mixture of experts' work arrays for B rows


class _DecodePass:
    """The block's ops for one token at ``pos``: single-row ops on RunState."""

    def __init__(self, model: "Model", s: RunState, pos: int):
        c = model.config
        self.b, self.eps, self.stream_eps, self.pos = model.backend, c.norm_eps, c.stream_norm_eps, pos
        self.scale, self.softcap, self.qk_whole = model.attn_scale, c.attn_softcap, c.qk_norm_whole
        self.x, self.xb, self.tmp, self.att, self.hb = s.x, s.xb, s.tmp, s.att, s.hb
        self.s = s

    def rmsnorm(self, out, x, w, eps=None):
        self.b.rmsnorm(out, x, w, self.eps if eps is None else eps)

    def linear(self, out, w, x):
        self.b.matvec(out, w, x)

    def linear_add(self, out, w, x):
        self.b.matvec_add(out, w, x)

    def add(self, out, y):
        self.b.add(out, out, y)

    def qkv(self, L: Layer, x):
        b, s = self.b, self.s
        if L.wqkv is not None:
            b.matvec(s.qkv, L.wqkv, x)
            if L.bqkv is not None:
                b.add(s.qkv, s.qkv, L.bqkv)
            return
        b.matvec(s.q, L.wq, x)
        b.matvec(s.k, L.wk, x)
        b.matvec(s.v, L.wv, x)
        if L.bq is not None:
            b.add(s.q, s.q, L.bq)
            b.add(s.k, s.k, L.bk)
            b.add(s.v, s.v, L.bv)

    def qk_norms(self, L: Layer):
        s = self.s
        if self.qk_whole:
            self.b.rmsnorm(s.q, s.q, L.q_norm, self.eps)
            self.b.rmsnorm(s.k, s.k, L.k_norm, self.eps)
        else:
            self.b.rmsnorm_batch(s.q_heads, s.q_heads, L.q_norm, self.eps)
            self.b.rmsnorm_batch(s.k_heads, s.k_heads, L.k_norm, self.eps)

    def rope_store(self, L: Layer):
        s = self.s
        if L.rope is None:
            self.b.cache_store(L.k_cache, L.v_cache, s.k, s.v, self.pos)
        else:
            self.b.rope_store(s.q, s.k, s.v, L.rope[0], L.rope[1], L.k_cache, L.v_cache, self.pos)

    def rope(self, L: Layer):
        if L.rope is not None:
            s = self.s
            self.b.rope(s.q, s.k, L.rope[0], L.rope[1], self.pos, L.k_cache.shape[2])

    def cache_store(self, L: Layer):
        s = self.s
        self.b.cache_store(L.k_cache, L.v_cache, s.k, s.v, self.pos)

    def attention(self, L: Layer):
        self.b.attention(self.att, self.s.q, L.k_cache, L.v_cache, self.pos, L.window, self.scale, self.softcap)

    def gate_up(self, L: Layer, act: str, x):
        self.b.gate_up(self.hb, L.w_gate, L.w_up, x, act)

    def moe(self, L: Layer, c: ModelConfig, x):
        self.b.moe(self.x, x, L.router, L.experts, c.n_experts_used, c.expert_norm, c.activation, self.s.moe)


class _PrefillPass:
    """The same ops for T prompt tokens at positions pos0.. : batched ops on BatchState rows."""

    def __init__(self, model: "Model", B: BatchState, T: int, pos0: int):
        c = model.config
        self.b, self.eps, self.stream_eps = model.backend, c.norm_eps, c.stream_norm_eps
        self.pos0, self.T = pos0, T
        self.scale, self.softcap = model.attn_scale, c.attn_softcap
        self.head_dim, self.qk_whole = c.head_dim, c.qk_norm_whole
        self.x, self.xb, self.tmp, self.att, self.hb = B.x[:T], B.xb[:T], B.tmp[:T], B.att[:T], B.hb[:T]
        self.q, self.k, self.v = B.q[:T], B.k[:T], B.v[:T]
        self.n_heads, self.n_kv = c.n_heads, c.n_kv_heads
        self.moe_scratch = B.moe

    def rmsnorm(self, out, x, w, eps=None):
        self.b.rmsnorm_batch(out, x, w, self.eps if eps is None else eps)

    def linear(self, out, w, x):
        self.b.matmul(out, w, x)

    def linear_add(self, out, w, x):
        self.b.matmul_add(out, w, x)

    def add(self, out, y):
        flat_out, flat_y = out.reshape(-1), y.reshape(-1)
        self.b.add(flat_out, flat_out, flat_y)

    def qkv(self, L: Layer, x):
        # three GEMMs even when fused: wq/wk/wv are row views of wqkv, and q, k, v stay
        # contiguous for the ops that follow
        b = self.b
        for out, w, bias in ((self.q, L.wq, L.bq), (self.k, L.wk, L.bk), (self.v, L.wv, L.bv)):
            b.matmul(out, w, x)
            if bias is not None:
                b.add_rows(out, out, bias)

    def qk_norms(self, L: Layer):
        T, hd = self.T, self.head_dim
        for rows, w, n in ((self.q, L.q_norm, self.n_heads), (self.k, L.k_norm, self.n_kv)):
            heads = rows if self.qk_whole else rows.reshape(T * n, hd)     # each row, or every head of it
            self.b.rmsnorm_batch(heads, heads, w, self.eps)

    def rope_store(self, L: Layer):
        self.rope(L)
        self.cache_store(L)

    def rope(self, L: Layer):
        if L.rope is not None:
            self.b.rope_batch(self.q, self.k, L.rope[0], L.rope[1], self.pos0, self.head_dim)

    def cache_store(self, L: Layer):
        self.b.cache_store_batch(L.k_cache, L.v_cache, self.k, self.v, self.pos0)

    def attention(self, L: Layer):
        self.b.attention_batch(self.att, self.q, L.k_cache, L.v_cache, self.pos0, L.window, self.scale,
                               self.softcap)

    def gate_up(self, L: Layer, act: str, x):
        self.b.gate_up_batch(self.hb, L.w_gate, L.w_up, x, act)

    def moe(self, L: Layer, c: ModelConfig, x):
        self.b.moe_batch(self.x, x, L.router, L.experts, c.n_experts_used, c.expert_norm, c.activation,
                         self.moe_scratch)


class Model:
    """A loaded model bound to one backend, with its KV cache and tokenizer."""

    def __init__(self, config: ModelConfig, weights: dict, tokenizer=None, backend="cpu",
                 threads=None, context: int | None = None, threads_batch=None,
                 consume_weights: bool = False):
        """consume_weights: the caller hands `weights` over; the entries leave the dict once
        uploaded (the globals first, then layer by layer), so host copies that the backend replaced (a GGUF's row-permuted q/k,
        reordered again by the CPU backend's r16 repack or copied to a GPU) are freed as the
        build goes instead of when the load returns."""
        from .loading import validate_weights

        validate_weights(config, weights)
        self.config = config
        self.family = family(config.arch)
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.cover_ids(config.vocab_size)      # padded embedding rows decode to no text
        self.backend = get_backend(backend, threads) if isinstance(backend, str) else backend
        if config.moe and {"moe", "moe_batch"} & set(self.backend.missing_ops()):
            raise UnsupportedModelError(f"a mixture-of-experts model ({config.n_experts} experts) does not run "
                                        f"on the {self.backend.name} backend (it has no moe op)")
        self.context = _resolve_context(config, context)
        # refuse before allocating a KV cache, rope tables or scratch that cannot fit
        check_model_fits(self.backend, config, self.context, weights, explicit=context is not None)
        self.threads_decode = self.backend.threads
        self.threads_prefill = self.backend.threads
        if threads_batch is not None:
            self.set_threads(self.backend.threads, threads_batch)
        self.weight_bytes = sum(int(a.nbytes) for a in weights.values())
        if any(isinstance(a, QuantMatrix) for a in weights.values()):
            self.backend.batch_rows_exact = True     # see Backend.batch_rows_exact
        self.batched_prefill = self.backend.supports_batch()
        self.attn_scale = config.attn_scale      # None: 1/sqrt(head_dim)
        self.batch: BatchState | None = None
        self.kv_owner = None                  # the generate.Session whose tokens the KV cache holds
        self.lock = threading.RLock()   # one cache: sessions take turns, one step at a time
        self._build(weights, consume_weights)
        if config.moe:      # see Backend.data_dependent_steps and data_dependent_prefill
            rows = self._batch_rows()
            if not all(self.backend.captures_moe_batch(L.experts, rows, config.n_experts_used) for L in self.layers):
                self.backend.data_dependent_prefill = True
            if not all(self.backend.captures_moe(L.experts) for L in self.layers):
                self.backend.data_dependent_steps = True

    @classmethod
    def from_weights(cls, config, weights, tokenizer=None, backend="cpu", threads=None, context=None,
                     threads_batch=None):
        return cls(config, weights, tokenizer, backend, threads, context, threads_batch)

    # -- construction ---------------------------------------------------------
    def _build(self, w: dict, consume: bool = False) -> None:
        c, b, fam = self.config, self.backend, self.family
        up = b.upload

        roles = {t.role: t for t in fam.tensors}

        def get(role: str, i: int | None = None):
            """The host array of a role, or None where this family or config has none."""
            t = roles.get(role)
            return w.get(t.hf_name(i)) if t is not None and t.when(c) else None

        self.embedding = up(get("token_embd.weight"))                   # (vocab, dim) f16
        final_norm = get("output_norm.weight")
        if c.logit_scale != 1.0:        # logits * s == the output matrix times (s * norm weight) times x
            final_norm = np.asarray(final_norm, np.float32) * np.float32(c.logit_scale)
        self.final_norm = up(final_norm)                                # (dim,) f32
        out = get("output.weight")
        self.output = up(out) if out is not None and not c.tie_word_embeddings else self.embedding
        del out
        if consume:             # the globals are uploaded: their host arrays may go now
            for t in fam.tensors:
                if not t.per_layer:
                    w.pop(t.hf_name(), None)
        tables: dict = {}     # one (cos, sin) pair per distinct rope
        qd, kd, f = c.q_dim, c.kv_dim, c.ffn_dim
        self.layers: list[Layer] = []
        for i in range(c.n_layers):
            wqkv = bqkv = None
            split_qkv = None
            if fam.fused_qkv:
                h = get("attn_qkv.weight", i)
                if isinstance(h, QuantMatrix) and not b.quant_row_views:
                    # the backend's quantized layout has no row views (cuda): three matrices,
                    # cut on the host where a QuantMatrix row slice is a zero-copy view
                    split_qkv = (up(h[:qd]), up(h[qd:qd + kd]), up(h[qd + kd:]))
                else:
                    wqkv = up(h)
            elif b.fuse_qkv and all(isinstance(get(r, i), np.ndarray) for r in QKV):
                # float16: one concatenated matrix, q/k/v its row views
                wqkv = up(np.concatenate([get(r, i) for r in QKV]))
            biases = [get(r, i) for r in ("attn_q.bias", "attn_k.bias", "attn_v.bias")]
            has_bias = all(x is not None for x in biases)
            if wqkv is not None:
                wq, wk, wv = wqkv[:qd], wqkv[qd:qd + kd], wqkv[qd + kd:]
            else:
                # quantized q/k/v stay three matrices (a concatenated copy of blocks would
                # double their memory, and Q4_K_M often gives v its own format); the backend
                # may stack them for decode (cuda: one launch when they share a format, or when v has
                # its own and the three fit one wave of blocks)
                wq, wk, wv = split_qkv if split_qkv is not None else (up(get(r, i)) for r in QKV)
                wqkv = b.stack_rows((wq, wk, wv)) if b.fuse_qkv else None
            if wqkv is not None and has_bias:
                bqkv = up(np.concatenate(biases))
            if bqkv is not None:
                bq, bk, bv = bqkv[:qd], bqkv[qd:qd + kd], bqkv[qd + kd:]
            elif has_bias:
                bq, bk, bv = (up(x) for x in biases)
            else:
                bq = bk = bv = None
            router = experts = None
            if c.moe:
                router = up(get("ffn_gate_inp.weight", i))                 # (n_experts, dim) f32
                names = [list(roles[r].hf_names(c, i)) for r in EXPERT_ROLES]
                experts = b.upload_experts([[w[n[e]] for n in names] for e in range(c.n_experts)])
                w_gate = w_up = None
            elif fam.fused_gate_up:
                h = get("ffn_gate_up.weight", i)                        # (2*ffn, dim): gate rows first
                if isinstance(h, QuantMatrix) and not b.quant_row_views:
                    w_gate, w_up = up(h[:f]), up(h[f:])
                else:
                    gu = up(h)
                    w_gate, w_up = gu[:f], gu[f:]
            else:
                w_gate, w_up = up(get("ffn_gate.weight", i)), up(get("ffn_up.weight", i))
            spec = c.layer_rope(i)
            key = None if spec is None else repr(spec)      # specs hold dicts: key by value
            if key is not None and key not in tables:
                cos, sin = spec.tables(self.context)                    # (context, rot/2) each
                tables[key] = (up(cos), up(sin))
            opt = lambda role: None if get(role, i) is None else up(get(role, i))  # noqa: E731
            self.layers.append(Layer(
                attn_norm=opt("attn_norm.weight"), wq=wq, wk=wk, wv=wv,
                wo=up(get("attn_output.weight", i)), ffn_norm=opt("ffn_norm.weight"),
                w_gate=w_gate, w_up=w_up, w_down=None if c.moe else up(get("ffn_down.weight", i)),
                k_cache=b.empty((c.n_kv_heads, self.context, c.head_dim), np.float16),
                v_cache=b.empty((c.n_kv_heads, self.context, c.head_dim), np.float16),
                window=c.layer_window(i), rope=None if key is None else tables[key],
                wqkv=wqkv, bq=bq, bk=bk, bv=bv, bqkv=bqkv,
                q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"),
                post_attn_norm=opt("post_attention_norm.weight"), post_ffn_norm=opt("post_ffw_norm.weight"),
                router=router, experts=experts))
            if consume:         # the layer holds what it needs: its host arrays may go now
                for t in fam.tensors:
                    if t.per_layer:
                        for name in t.hf_names(c, i):
                            w.pop(name, None)
        if c.residual_scale != 1.0 and any(L.attn_norm is None or L.ffn_norm is None for L in self.layers):
            # the stream is carried divided by residual_scale (config.py): only norms may read it
            raise ModelLoadError("a residual scale needs a norm before every sub-block")
        qkv = b.empty((qd + 2 * kd,))
        q, k = qkv[:qd], qkv[qd:qd + kd]
        self.state = RunState(
            qkv=qkv, x=b.empty((c.dim,)), xb=b.empty((c.dim,)), tmp=b.empty((c.dim,)), q=q, k=k,
            v=qkv[qd + kd:], q_heads=q.reshape(c.n_heads, c.head_dim), k_heads=k.reshape(c.n_kv_heads, c.head_dim),
            att=b.empty((qd,)), hb=b.empty((c.ffn_dim,)), logits=b.empty((c.vocab_size,)),
            moe=self._moe_scratch(1, batch=False))

    def _moe_scratch(self, rows: int, batch: bool) -> MoeScratch | None:
        c = self.config
        return MoeScratch.allocate(self.backend, rows, c.dim, c.ffn_dim, c.n_experts, c.n_experts_used,
                                   batch) if c.moe else None

    # -- the forward pass: one block body for decode and prefill ---------------
    def _block(self, o, L: Layer) -> None:
        """One transformer block on pass ``o`` (one token or T tokens, same ops)."""
        act = self.config.activation
        # x is the residual stream as ModelConfig carries it (divided by residual_scale), so its
        # norms take stream_eps; a block's own norms (q/k, post) take eps
        # attention: x += [post_norm] wo @ attention(rope(qnorm(wq xb)), rope(knorm(wk xb)), wv xb)
        o.qkv(L, self._pre_norm(o, L.attn_norm))
        if L.q_norm is not None and self.config.qk_norm_after_rope:
            o.rope(L)                   # Hunyuan: the norms take the rotated q and k
            o.qk_norms(L)
            o.cache_store(L)
        else:
            if L.q_norm is not None:
                o.qk_norms(L)
            o.rope_store(L)
        o.attention(L)
        self._residual(o, L.wo, o.att, L.post_attn_norm)
        # MLP: x += [post_norm] w_down @ (act(w_gate xb) * (w_up xb)); a mixture of experts adds
        # its chosen experts' MLPs instead (no post norm: ModelConfig refuses one)
        if L.experts is not None:
            o.moe(L, self.config, self._pre_norm(o, L.ffn_norm))
            return
        o.gate_up(L, act, self._pre_norm(o, L.ffn_norm))
        self._residual(o, L.w_down, o.hb, L.post_ffn_norm)

    @staticmethod
    def _pre_norm(o, w):
        """A sub-block's input: the stream normed into xb, or (no pre-norm) the stream itself."""
        if w is None:
            return o.x
        o.rmsnorm(o.xb, o.x, w, o.stream_eps)
        return o.xb

    @staticmethod
    def _residual(o, w, h, post_norm) -> None:
        if post_norm is None:
            o.linear_add(o.x, w, h)
        else:
            o.linear(o.tmp, w, h)
            o.rmsnorm(o.tmp, o.tmp, post_norm)
            o.add(o.x, o.tmp)

    def _issue_forward_ops(self, token: int, pos: int) -> None:
        """Queue every op of one token's forward pass; logits land in state.logits."""
        b, s, c = self.backend, self.state, self.config
        b.embed(s.x, self.embedding, token, c.stream_embed_scale)
        o = _DecodePass(self, s, pos)
        for L in self.layers:
            self._block(o, L)
        b.rmsnorm(s.xb, s.x, self.final_norm, c.stream_norm_eps)
        b.matvec(s.logits, self.output, s.xb)

    def _issue_batch_ops(self, T: int, pos0: int, all_logits: bool) -> None:
        """The forward pass for T prompt tokens at once (same block body); with ``all_logits``
        every row's logits (the last token's alone are _issue_last_logits', after the chunks)."""
        b, c, B = self.backend, self.config, self.batch
        b.embed_batch(B.x[:T], self.embedding, B.tokens[:T], c.stream_embed_scale)
        o = _PrefillPass(self, B, T, pos0)
        for L in self.layers:
            self._block(o, L)
        if all_logits:
            b.rmsnorm_batch(B.xb[:T], B.x[:T], self.final_norm, c.stream_norm_eps)
            b.matmul(B.logits[:T], self.output, B.xb[:T])

    def _issue_last_logits(self, row: int) -> None:
        """The logits of row ``row`` of the last chunk (its final token) -> state.logits."""
        b, s = self.backend, self.state
        b.rmsnorm(s.xb, self.batch.x[row], self.final_norm, self.config.stream_norm_eps)
        b.matvec(s.logits, self.output, s.xb)

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Run one token at position ``pos``; returns logits (vocab,) f32 on the host.

        The returned array is reused by the next call: copy it to keep it.
        """
        self._check_token(token)
        if not 0 <= pos < self.context:
            raise ContextFullError(f"position {pos} is outside the context window of {self.context} tokens")
        self.kv_owner = None      # the cache changes under whichever session held it (it re-claims)
        self.backend.decode_step(self._issue_forward_ops, token, pos)
        return self._final_cap(self.backend.to_host(self.state.logits))

    def prefill(self, tokens, pos0: int = 0, all_logits: bool = False) -> np.ndarray:
        """Fill the KV cache with ``tokens`` at positions pos0.. .

        Returns the logits of the last token (vocab,), or with ``all_logits``
        those of every token (len(tokens), vocab) in a new array. The cache holds nothing
        valid past the last of them afterwards: a backend may pad a chunk (prefill_rows)
        and overwrite a few positions after it.
        """
        tokens = self._check_ids(tokens)
        if pos0 < 0 or pos0 + len(tokens) > self.context:
            raise ContextFullError(
                f"{len(tokens)} tokens from position {pos0} do not fit in the context window "
                f"of {self.context} tokens")
        out = np.empty((len(tokens), self.config.vocab_size), np.float32) if all_logits else None
        self.kv_owner = None      # positions from pos0 on change: no session's tokens are there now
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
    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per batched pass (the backend's choice)."""
        return int(self.backend.prefill_chunk)

    def _batch_rows(self) -> int:
        """Rows of a BatchState: a prefill chunk, never more than the context."""
        return min(self.prefill_chunk, self.context)

    def _batch_state(self, all_logits: bool) -> BatchState:
        c, b = self.config, self.backend
        if self.batch is None:
            n = self._batch_rows()
            self.batch = BatchState(
                tokens=np.zeros(n, np.int32), x=b.empty((n, c.dim)), xb=b.empty((n, c.dim)),
                tmp=b.empty((n, c.dim)), q=b.empty((n, c.q_dim)), k=b.empty((n, c.kv_dim)),
                v=b.empty((n, c.kv_dim)), att=b.empty((n, c.q_dim)), hb=b.empty((n, c.ffn_dim)),
                moe=self._moe_scratch(n, batch=True))
        if all_logits and self.batch.logits is None:
            self.batch.logits = b.empty((self.batch.tokens.shape[0], c.vocab_size))
        return self.batch

    def _prefill_batched(self, tokens: list[int], pos0: int, out: np.ndarray | None) -> np.ndarray:
        B = self._batch_state(out is not None)
        chunk = B.tokens.shape[0]
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            t = len(part)
            # A backend that replays captured chunks may run a short one at a longer length it
            # keeps a graph for. The rows past t repeat the last id: they write cache positions
            # past the prompt, which a later token overwrites before anything reads them.
            rows = self.backend.prefill_rows(t, min(chunk, self.context - pos0 - start))
            B.tokens[:t] = part
            B.tokens[t:rows] = part[-1]
            self.backend.prefill_step(self._issue_batch_ops, B, B.tokens[:rows], pos0 + start, out is not None)
            if out is not None:
                out[start:start + t] = self.backend.to_host(B.logits)[:t]
        if out is not None:
            return self._final_cap(out)[-1]
        self.backend.run_ops(self._issue_last_logits, t - 1)
        return self._final_cap(self.backend.to_host(self.state.logits))

    def _final_cap(self, logits: np.ndarray) -> np.ndarray:
        """The logits soft-capped in place (Gemma 2's final_logit_softcapping) on the host, where
        they are read: z -> c * tanh(z / c), three in-place passes, no allocation."""
        c = self.config.final_softcap
        if c:
            np.divide(logits, c, out=logits)
            np.tanh(logits, out=logits)
            np.multiply(logits, c, out=logits)
        return logits

    # -- generation (the loop lives in generate.py) ---------------------------
    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float | None = None,
                 seed: int | None = None, stop=None, *, repetition_penalty: float | None = None,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_last_n: int = 64,
                 logit_bias: dict | None = None, session=None, stats=None, add_special_tokens: bool = True):
        """Stream generated text pieces for ``prompt`` (a string or token ids).

        Greedy by default (temperature 0). ``stop``: one string or a list of
        strings. ``repeat_penalty`` (llama.cpp's name) = ``repetition_penalty``.
        ``logit_bias``: {token id: bias} added to the logits (OpenAI's). See generate.generate.
        """
        from .generate import generate
        return generate(self, prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                        repeat_penalty=repeat_penalty, seed=seed, stop=stop, session=session, stats=stats,
                        add_special_tokens=add_special_tokens, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, repeat_last_n=repeat_last_n, logit_bias=logit_bias)

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
        dec = parse_threads(decode)
        pre = parse_threads(prefill, "threads-batch") if prefill is not None else dec
        # the prompt's team is set once now too (the cpu backend asks the system for a count
        # the first time it sees it), so a count it refuses fails here, not at the first
        # prompt, and leaves the backend as it was
        before = self.backend.threads
        try:
            if pre != dec:
                self.backend.set_threads(pre)
            self.backend.set_threads(dec)
        except Exception:
            self.backend.set_threads(before)
            raise
        self.threads_decode, self.threads_prefill = dec, pre

    # -- argument checks -------------------------------------------------------
    def _check_token(self, token) -> None:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise InvalidArgumentError(f"token ids must be integers, got {token!r}")
        if not 0 <= token < self.config.vocab_size:
            raise InvalidArgumentError(f"token id {token} is out of range [0, {self.config.vocab_size})")

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise InvalidArgumentError(f"token ids must be a list of integers, got {type(ids).__name__}")
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
        raise InvalidArgumentError(f"context must be a positive integer, got {one_line(repr(context), 40)}")
    if context > MAX_CONTEXT:
        raise InvalidArgumentError(f"context {int(context)} is beyond what cyllm supports (at most {MAX_CONTEXT} tokens)")
    return int(context)
