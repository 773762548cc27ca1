"""The small deterministic decoder-only transformer every worker runs.

It exists so that a cache hit saves real compute: K and V of prompt tokens are
computed by a real (random-weight) model, chunk by chunk over cached KV, and
greedy decoding reads them. Weights come from ``ModelConfig.seed`` through a
`torch.Generator` on the CPU, so every process builds bit-identical weights.

Architecture (Llama-shaped, tiny)::

    tokens ─► embed ─► [ RMSNorm ─► GQA attention (RoPE) ─► + ─► RMSNorm ─► SwiGLU ─► + ] x L
                                                                        ─► RMSNorm ─► lm_head

KV layout of one call (what `prefill` takes and returns), matching one page of
the KV store ``[num_pages, L, 2, page_size, kv_heads, head_dim]`` with the page
axis moved inside::

    kv[layer, 0 = K | 1 = V, token, kv_head, head_dim]

K is stored after RoPE, so cached K never needs its positions again. The model
holds no per-request state: concurrent calls from several threads are safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmesh.config import ModelConfig
from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.worker.devices import resolve_device

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""Registry of the KV / weight dtypes a config may name."""


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config name; `ConfigError` names the choices."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown model dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half form) on ``x [n, heads, head_dim]`` with ``cos/sin [n, head_dim/2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights (``x @ w`` layout: ``[fan_in, fan_out]``)."""

    attn_norm: Tensor
    wqkv: Tensor
    wo: Tensor
    mlp_norm: Tensor
    w_gate_up: Tensor
    w_down: Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> LayerWeights:
        return LayerWeights(
            *(getattr(self, f.name).to(device=device, dtype=dtype) for f in fields(self))
        )


def _linear(gen: torch.Generator, fan_in: int, fan_out: int) -> Tensor:
    return torch.randn(fan_in, fan_out, generator=gen) / math.sqrt(fan_in)


def _init_layer(cfg: ModelConfig, gen: torch.Generator) -> LayerWeights:
    d = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    return LayerWeights(
        attn_norm=torch.ones(d),
        wqkv=_linear(gen, d, d + 2 * kv),
        wo=_linear(gen, d, d),
        mlp_norm=torch.ones(d),
        w_gate_up=_linear(gen, d, 2 * cfg.ffn_dim),
        w_down=_linear(gen, cfg.ffn_dim, d),
    )


class TinyTransformer:
    """Decoder-only transformer with GQA, RoPE, RMSNorm and a SwiGLU MLP.

    `prefill` computes the KV of new tokens attending causally over given past
    KV; `generate` is the from-scratch reference. Computing a prompt at once or
    chunk by chunk over its own cached KV gives the same KV up to float
    rounding (different matmul shapes) and the same greedy tokens.

    Weights are plain tensors, not an `nn.Module`: nothing here trains, so
    there is no train mode to forget; every compute method runs under
    `torch.inference_mode`. Weights are drawn in float32 on the CPU in a fixed
    order from one generator, then cast, so any process on any device gets
    the same model.
    """

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        cfg = cfg or ModelConfig()
        _validate(cfg)
        self.cfg = cfg
        self.dtype = resolve_dtype(cfg.dtype)
        self.device = resolve_device(cfg.device)  # "auto": cuda when this process has one
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.hidden = cfg.num_heads * cfg.head_dim
        self.eps = cfg.norm_eps

        dev, dt = self.device, self.dtype
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = torch.randn(cfg.vocab_size, self.hidden, generator=gen).to(dev, dt)
        self.layers = tuple(_init_layer(cfg, gen).to(dev, dt) for _ in range(cfg.num_layers))
        self.final_norm = torch.ones(self.hidden).to(dev, dt)
        self.lm_head = _linear(gen, self.hidden, cfg.vocab_size).to(dev, dt)
        half = cfg.head_dim // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv_freq)
        self.rope_cos = angles.cos().to(dev, dt)
        self.rope_sin = angles.sin().to(dev, dt)

    # -- shapes -----------------------------------------------------------------------------

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of `num_tokens` tokens: ``[L, 2, n, kv_heads, head_dim]``."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def empty_kv(self, num_tokens: int) -> Tensor:
        """An uninitialised KV buffer for `num_tokens` tokens (dtype and device of the model)."""
        return torch.empty(self.kv_shape(num_tokens), dtype=self.dtype, device=self.device)

    # -- compute ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int] | Tensor,
        past_kv: Tensor | None = None,
        start_pos: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """KV of `token_ids` at positions ``start_pos...`` attending over `past_kv`, causally.

        `past_kv` ``[L, 2, n_past, kv_heads, head_dim]`` holds positions ``0..n_past-1``;
        `start_pos` defaults to and must equal ``n_past``. Returns the logits after
        the last new token ``[vocab]`` (float32) and the new KV ``[L, 2, n_new, ...]``.
        Cost: ``O(L * n_new * (n_past + n_new))`` attention plus ``O(L * n_new)`` MLP.
        """
        n_past = 0 if past_kv is None else int(past_kv.shape[2])
        if past_kv is not None and tuple(past_kv.shape) != self.kv_shape(n_past):
            raise InvalidInput(
                f"past_kv must have shape {self.kv_shape(n_past)}, got {tuple(past_kv.shape)}"
            )
        if start_pos is not None and start_pos != n_past:
            raise InvalidInput(
                f"start_pos {start_pos} must equal the number of past tokens {n_past}: "
                "causal attention needs the KV of every earlier position"
            )
        tokens = self._tokens(token_ids, n_past)
        window = self.empty_kv(n_past + len(tokens))
        if past_kv is not None:
            window[:, :, :n_past] = past_kv
        logits = self._forward(tokens, window, n_past)
        return logits, window[:, :, n_past:]

    @torch.inference_mode()
    def prefill_into(self, kv: Tensor, num_past: int, token_ids: Sequence[int] | Tensor) -> Tensor:
        """Like `prefill`, in place: past KV is ``kv[:, :, :num_past]``, new KV goes after it.

        `kv` ``[L, 2, capacity, ...]`` is a request's buffer; positions
        ``num_past..num_past+n-1`` are overwritten. Returns the last logits. No copy of
        the past is made, which is what chunked prefill and decoding want.
        """
        tokens = self._tokens(token_ids, num_past)
        self._check_buffer(kv, num_past + len(tokens))
        return self._forward(tokens, kv[:, :, : num_past + len(tokens)], num_past)

    @torch.inference_mode()
    def decode(
        self,
        token_id: int,
        kv: Tensor,
        num_filled: int,
        max_new: int = 1,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[list[int], Tensor]:
        """Greedy decoding of `max_new` tokens after `token_id`, in a request's KV buffer.

        `kv` ``[L, 2, capacity, ...]`` holds the KV of positions ``0..num_filled-1``;
        `token_id` (the last sampled token) goes to position `num_filled`, and each
        step writes its KV in place. Returns the `max_new` tokens that follow and
        the logits after the last of them. Needs ``capacity >= num_filled + max_new``.
        `stop` is asked before every step; once it says True decoding ends there and
        fewer tokens come back (how a cancelled request stops between steps).
        """
        self._check_buffer(kv, num_filled + max_new)
        out: list[int] = []
        tok = token_id
        logits = torch.empty(0)
        for pos in range(num_filled, num_filled + max_new):
            if stop is not None and stop():
                break
            logits = self._forward(self._tokens([tok], pos), kv[:, :, : pos + 1], pos)
            tok = int(torch.argmax(logits))
            out.append(tok)
        return out, logits

    @torch.inference_mode()
    def generate_from(
        self, first_logits: Tensor, kv: Tensor, num_filled: int, max_tokens: int
    ) -> list[int]:
        """Greedy answer of `max_tokens` tokens given the prompt's last logits and KV buffer.

        The first token is the argmax of `first_logits`; the other ``max_tokens - 1``
        are decoded in `kv` (capacity at least ``num_filled + max_tokens - 1``).
        """
        if max_tokens <= 0:
            return []
        first = int(torch.argmax(first_logits))
        rest, _ = self.decode(first, kv, num_filled, max_tokens - 1)
        return [first, *rest]

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int] | Tensor, max_tokens: int) -> list[int]:
        """Reference: the whole prompt at once from scratch, then greedy decoding."""
        if max_tokens < 0:
            raise InvalidInput(f"max_tokens must be >= 0, got {max_tokens}")
        n = len(prompt)
        kv = self.empty_kv(n + max(max_tokens - 1, 0))
        logits = self.prefill_into(kv, 0, prompt)
        return self.generate_from(logits, kv, n, max_tokens)

    # -- internals --------------------------------------------------------------------------

    def _tokens(self, token_ids: Sequence[int] | Tensor, start: int) -> Tensor:
        t = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if t.dim() != 1 or t.numel() == 0:
            raise InvalidInput(
                f"token_ids must be a non-empty 1-D sequence, got shape {tuple(t.shape)}"
            )
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise InvalidInput(
                f"token ids must lie in [0, {self.cfg.vocab_size}), got range [{lo}, {hi}]"
            )
        if start + t.numel() > self.cfg.max_positions:
            raise InvalidInput(
                f"{start + t.numel()} positions exceed max_positions={self.cfg.max_positions}"
            )
        return t

    def _check_buffer(self, kv: Tensor, needed: int) -> None:
        want = self.kv_shape(kv.shape[2]) if kv.dim() == 5 else None
        if want is None or tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise InvalidInput(
                f"KV buffer must be {self.dtype} [L, 2, capacity, kv_heads, head_dim] = "
                f"{self.kv_shape(needed)} or longer, got {kv.dtype} {tuple(kv.shape)}"
            )
        if kv.shape[2] < needed:
            raise InvalidInput(f"KV buffer holds {kv.shape[2]} positions, {needed} are needed")

    def _logits(self, h: Tensor) -> Tensor:
        return (_rms_norm(h, self.final_norm, self.eps) @ self.lm_head).float()

    def _forward(self, tokens: Tensor, window: Tensor, n_past: int) -> Tensor:
        """Logits after the last of `tokens`, whose positions start at `n_past`.

        `window` ``[L, 2, n_past + n, ...]`` holds the past KV in its first `n_past`
        positions; the KV of `tokens` is written into the rest, so attention reads
        one contiguous range without concatenating.
        """
        n = tokens.shape[0]
        total = n_past + n
        h_q, h_kv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos = self.rope_cos[n_past:total]
        sin = self.rope_sin[n_past:total]
        mask: Tensor | None = None
        if n > 1 and n_past > 0:  # is_causal aligns top-left, wrong when queries start later
            rows = torch.arange(n, device=self.device)[:, None] + n_past
            mask = rows >= torch.arange(total, device=self.device)[None, :]
        x = self.embed[tokens]
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, self.eps)
            qkv = h @ layer.wqkv
            q = qkv[:, : h_q * dim].view(n, h_q, dim)
            k = qkv[:, h_q * dim : (h_q + h_kv) * dim].view(n, h_kv, dim)
            window[li, 0, n_past:] = _rotate(k, cos, sin)
            window[li, 1, n_past:] = qkv[:, (h_q + h_kv) * dim :].view(n, h_kv, dim)
            # [tokens, heads, dim] -> [1, heads, tokens, dim]: with 3-D inputs torch's CPU
            # SDPA falls back to its ~10x slower math path
            attn = F.scaled_dot_product_attention(
                _rotate(q, cos, sin).transpose(0, 1)[None],
                window[li, 0].transpose(0, 1)[None],
                window[li, 1].transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=n > 1 and n_past == 0,
                enable_gqa=True,
            )
            x = x + attn[0].transpose(0, 1).reshape(n, h_q * dim) @ layer.wo
            h = _rms_norm(x, layer.mlp_norm, self.eps)
            gate, up = (h @ layer.w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.w_down
        return self._logits(x[-1])


def _validate(cfg: ModelConfig) -> None:
    problems = []
    if cfg.num_heads % cfg.num_kv_heads:
        problems.append(
            f"num_heads={cfg.num_heads} is not a multiple of num_kv_heads={cfg.num_kv_heads}"
        )
    if cfg.head_dim % 2:
        problems.append(f"head_dim={cfg.head_dim} must be even for RoPE")
    if min(cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim) <= 0:
        problems.append(
            "vocab_size, num_layers, num_heads, num_kv_heads and ffn_dim must be positive"
        )
    if problems:
        raise ConfigError("invalid ModelConfig: " + "; ".join(problems))
    resolve_dtype(cfg.dtype)
