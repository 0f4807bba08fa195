"""A torch reference of Hugging Face's Mamba2ForCausalLM forward pass (fp32, one sequence).

It follows transformers' `torch_forward` path of modeling_mamba2.py:

    x -> RMSNorm -> in_proj -> [gate z | xBC | dt]
    xBC -> causal depthwise conv1d (left context = carried conv state) -> SiLU -> [x | B | C]
    dt  -> softplus(dt + dt_bias), clamped to time_step_limit (prefill only, as HF does)
    A   =  -exp(A_log)
    y   =  SSM(x, dt, A, B, C) + D * x         (chunked SSD scan for a prefill, recurrence for 1 token)
    y   -> RMSNorm over groups of (y * silu(z))  (gate before norm: norm_before_gate=False)
    out_proj, residual add; then final RMSNorm and lm_head (tied to the embedding or not).

The recurrent state of a sequence is, per layer, the last `conv_kernel` conv inputs
(`conv_state [conv_dim, conv_kernel]`) and the SSM state (`ssm_state [heads, head_dim, state_size]`),
both fp32, as HF's cache holds them. `forward(tokens, state)` never mutates `state`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from superfluid.engine.checkpoint import read_text
from superfluid.engine.config import MAX_LAYERS
from superfluid.engine.weights import WeightError, _tensor_files, check_headers

__all__ = ["Mamba2Config", "Mamba2Model", "Mamba2State", "WeightError"]


# config.json's integer fields and Mamba2Config's defaults for them.
_INT_FIELDS = {"vocab_size": 32768, "hidden_size": 4096, "state_size": 128, "num_heads": 128, "head_dim": 64,
               "n_groups": 8, "expand": 2, "conv_kernel": 4, "chunk_size": 256, "num_hidden_layers": 64}


@dataclass(frozen=True)
class Mamba2Config:
    vocab_size: int
    hidden_size: int
    state_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    expand: int
    conv_kernel: int
    chunk_size: int
    num_layers: int
    eps: float
    tie_word_embeddings: bool
    use_bias: bool
    use_conv_bias: bool
    time_step_limit: tuple[float, float]

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    @property
    def conv_dim(self) -> int:  # the conv runs over x, B and C together
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_dict(cls, d: dict) -> Mamba2Config:
        if d.get("model_type") != "mamba2":
            raise WeightError(f"not a Mamba2 config (model_type={d.get('model_type')!r})")
        if d.get("hidden_act", "silu") != "silu":
            raise WeightError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("norm_before_gate", False) or not d.get("rms_norm", True):
            raise WeightError("only the gated RMSNorm with the gate before the norm is supported (as in HF)")
        # Defaults are Mamba2Config's own, so a config.json that omits a key means the same here.
        for key, default in _INT_FIELDS.items():
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise WeightError(f"config.json {key}: must be a positive integer, got {str(v)[:40]}")
        if d.get("num_hidden_layers", 64) > MAX_LAYERS:
            raise WeightError(f"config.json num_hidden_layers: must be at most {MAX_LAYERS}")
        lim = d.get("time_step_limit", (0.0, math.inf))
        try:
            lim = (_num(lim[0]), _num(lim[1]))
            if len(d.get("time_step_limit", lim)) != 2:
                raise ValueError
        except (TypeError, ValueError, KeyError, IndexError):
            raise WeightError(f"config.json time_step_limit: must be a pair of numbers, got {str(lim)[:40]}") \
                from None
        cfg = cls(
            vocab_size=d.get("vocab_size", 32768), hidden_size=d.get("hidden_size", 4096),
            state_size=d.get("state_size", 128), num_heads=d.get("num_heads", 128),
            head_dim=d.get("head_dim", 64), n_groups=d.get("n_groups", 8), expand=d.get("expand", 2),
            conv_kernel=d.get("conv_kernel", 4), chunk_size=d.get("chunk_size", 256),
            num_layers=d.get("num_hidden_layers", 64), eps=d.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=d.get("tie_word_embeddings", False), use_bias=d.get("use_bias", False),
            use_conv_bias=d.get("use_conv_bias", True), time_step_limit=lim,
        )
        if cfg.intermediate_size != cfg.num_heads * cfg.head_dim:
            raise WeightError(f"hidden_size*expand ({cfg.intermediate_size}) != num_heads*head_dim "
                              f"({cfg.num_heads * cfg.head_dim})")
        if cfg.num_heads % cfg.n_groups:
            raise WeightError(f"num_heads ({cfg.num_heads}) is not a multiple of n_groups ({cfg.n_groups})")
        return cfg

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the config implies, by HF name (a tied head is not stored)."""
        h, i, k = self.hidden_size, self.intermediate_size, self.conv_kernel
        proj = i + self.conv_dim + self.num_heads  # z, xBC, dt
        s = {"backbone.embeddings.weight": (self.vocab_size, h)}
        for l in range(self.num_layers):
            p = f"backbone.layers.{l}."
            s[p + "norm.weight"] = (h,)
            s[p + "mixer.in_proj.weight"] = (proj, h)
            if self.use_bias:
                s[p + "mixer.in_proj.bias"] = (proj,)
            s[p + "mixer.conv1d.weight"] = (self.conv_dim, 1, k)
            if self.use_conv_bias:
                s[p + "mixer.conv1d.bias"] = (self.conv_dim,)
            for n in ("dt_bias", "A_log", "D"):
                s[p + "mixer." + n] = (self.num_heads,)
            s[p + "mixer.norm.weight"] = (i,)
            s[p + "mixer.out_proj.weight"] = (h, i)
            if self.use_bias:
                s[p + "mixer.out_proj.bias"] = (h,)
        s["backbone.norm_f.weight"] = (h,)
        if not self.tie_word_embeddings:
            s["lm_head.weight"] = (self.vocab_size, h)
        return s


@dataclass
class Mamba2State:
    """A sequence's recurrent state: per layer conv_state [conv_dim, K] and ssm_state [H, P, N] (fp32)."""
    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]

    @classmethod
    def zeros(cls, cfg: Mamba2Config) -> Mamba2State:
        # Zeros are exactly what HF starts from: its prefill left-pads the conv with zeros
        # and its scan starts from a zero SSM state.
        return cls([torch.zeros(cfg.conv_dim, cfg.conv_kernel) for _ in range(cfg.num_layers)],
                   [torch.zeros(cfg.num_heads, cfg.head_dim, cfg.state_size) for _ in range(cfg.num_layers)])

    def clone(self) -> Mamba2State:
        return Mamba2State([c.clone() for c in self.conv], [s.clone() for s in self.ssm])


def _num(v) -> float:
    # transformers 5 writes non-finite floats as {"__float__": "Infinity"}; older ones as Infinity.
    return float(v["__float__"] if isinstance(v, dict) else v)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ssd_chunk_scan(x, dt, A, B, C, chunk: int, h0):
    """The SSD chunked scan of one sequence from initial state h0.

    x [n, H, P], dt [n, H] (already softplus'd), A [H], B/C [n, H, N] (already per head),
    h0 [H, P, N]. Returns y [n, H, P] (without the D skip) and the final state [H, P, N].
    Within a chunk the scan is a masked "attention" (quadratic, parallel); between chunks
    the state is carried by a plain recurrence over chunk boundaries.
    """
    n = x.shape[0]
    pad = (-n) % chunk
    # Padding with dt = 0 (so dA = 0 and x*dt = 0) leaves the state untouched.
    dA = F.pad(dt * A, (0, 0, 0, pad))                                # [n', H]
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))              # [n', H, P]
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (B, C))           # [n', H, N]
    c = (n + pad) // chunk
    dA, xdt, B, C = (t.reshape(c, chunk, *t.shape[1:]) for t in (dA, xdt, B, C))
    acs = torch.cumsum(dA, dim=1)                                     # [c, L, H] log-decay from chunk start

    # Intra-chunk: y_l = sum_{s<=l} exp(acs_l - acs_s) (C_l . B_s) xdt_s.
    seg = acs[:, :, None, :] - acs[:, None, :, :]                     # [c, l, s, H]
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool))[None, :, :, None]
    decay = torch.exp(seg.masked_fill(~causal, -math.inf))            # masked before exp: no inf*0
    y = torch.einsum("clhn,cshn,clsh,cshp->clhp", C, B, decay, xdt)

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(acs[:, -1:, :] - acs)                          # [c, L, H]
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", B, to_end, xdt)

    # Inter-chunk recurrence: the state entering each chunk, then its effect on the outputs.
    h, starts = h0, []
    for i in range(c):
        starts.append(h)
        h = torch.exp(acs[i, -1])[:, None, None] * h + chunk_states[i]
    starts = torch.stack(starts)                                      # [c, H, P, N]
    y = y + torch.einsum("clhn,chpn,clh->clhp", C, starts, torch.exp(acs))
    return y.reshape(c * chunk, *y.shape[2:])[:n], h


def ssm_step(x, dt, A, B, C, h):
    """One token of the recurrence: x [H, P], dt [H], B/C [H, N], h [H, P, N] -> (y [H, P], h')."""
    h = torch.exp(dt * A)[:, None, None] * h + (dt[:, None] * x)[:, :, None] * B[:, None, :]
    return torch.einsum("hpn,hn->hp", h, C), h


class Mamba2Model:
    def __init__(self, cfg: Mamba2Config, weights: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, weights

    @classmethod
    def load(cls, path: str | Path) -> Mamba2Model:
        d = Path(path)
        try:
            raw = json.loads(read_text(d / "config.json"))
        except (OSError, ValueError) as e:
            raise WeightError(f"{d}: cannot read config.json ({e})") from None
        cfg = Mamba2Config.from_dict(raw)
        return cls(cfg, _load_weights(d, cfg))

    def forward(self, tokens: torch.Tensor, state: Mamba2State | None = None
                ) -> tuple[torch.Tensor, Mamba2State]:
        """Logits [n, vocab] (fp32) for `tokens` [n] fed after `state`, and the state after them.
        A 1-token feed takes the recurrent update; longer feeds the chunked scan."""
        cfg, w = self.cfg, self.w
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if tokens.numel() == 0:
            raise ValueError("empty feed")
        state = Mamba2State.zeros(cfg) if state is None else state
        new = Mamba2State([], [])
        with torch.no_grad():
            hid = w["backbone.embeddings.weight"][tokens]
            for l in range(cfg.num_layers):
                p = f"backbone.layers.{l}."
                y, conv, ssm = self._mixer(p + "mixer.", _rms(hid, w[p + "norm.weight"], cfg.eps),
                                           state.conv[l], state.ssm[l])
                hid = hid + y
                new.conv.append(conv)
                new.ssm.append(ssm)
            hid = _rms(hid, w["backbone.norm_f.weight"], cfg.eps)
            return hid @ w["lm_head.weight"].T, new

    def _mixer(self, p: str, u: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        cfg, w = self.cfg, self.w
        n, H, P, N, G = u.shape[0], cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
        zxbcdt = F.linear(u, w[p + "in_proj.weight"], w.get(p + "in_proj.bias"))
        z, xbc, dt = zxbcdt.split([cfg.intermediate_size, cfg.conv_dim, H], dim=-1)

        # Causal depthwise conv: the carried state supplies the left context; the new state
        # is the last K conv inputs (as HF's cache keeps them).
        full = torch.cat([conv_state, xbc.T], dim=-1)                    # [conv_dim, K + n]
        conv = F.conv1d(full[None], w[p + "conv1d.weight"], w.get(p + "conv1d.bias"),
                        groups=cfg.conv_dim)[0, :, -n:]                  # [conv_dim, n]
        new_conv = full[:, -cfg.conv_kernel:].clone()
        x, B, C = F.silu(conv.T).split([cfg.intermediate_size, G * N, G * N], dim=-1)
        x = x.reshape(n, H, P)
        # Groups share B and C across their H/G heads.
        B, C = (t.reshape(n, G, N).repeat_interleave(H // G, dim=1) for t in (B, C))

        A = -torch.exp(w[p + "A_log"])
        dt = F.softplus(dt + w[p + "dt_bias"])
        if n == 1:
            # HF's single-token path (like mamba-ssm's step) does not apply time_step_limit.
            y, new_ssm = ssm_step(x[0], dt[0], A, B[0], C[0], ssm_state)
            y = y[None]
        else:
            dt = dt.clamp(*cfg.time_step_limit)
            y, new_ssm = ssd_chunk_scan(x, dt, A, B, C, cfg.chunk_size, ssm_state)
        y = (y + w[p + "D"][:, None] * x).reshape(n, H * P)

        # Gated RMSNorm: gate first, then normalise each of the n_groups slices separately.
        g = (y * F.silu(z)).reshape(n, G, -1)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + cfg.eps)).reshape(n, -1)
        out = F.linear(w[p + "norm.weight"] * g, w[p + "out_proj.weight"], w.get(p + "out_proj.bias"))
        return out, new_conv, new_ssm


def check_weights(d: Path, cfg: Mamba2Config) -> dict[str, tuple[Path, str]]:
    """Every tensor the config implies: our name -> (its file, its name there),
    names, shapes and dtypes checked from the headers, no data read; a
    missing, unexpected, misshapen or non-float tensor is named."""
    # Older exports call the embedding "backbone.embedding.weight" (HF's load hook renames it).
    alias = {"backbone.embedding.weight": "backbone.embeddings.weight"}
    stored = _tensor_files(d)
    files = {alias.get(k, k): v for k, v in stored.items()}
    src = {alias.get(k, k): k for k in stored}  # our name -> the name in the file
    if cfg.num_layers > len(files):  # before a list of every layer's tensors is made
        raise WeightError(f"{d}: the config's num_hidden_layers {cfg.num_layers} is more than the "
                          f"{len(files)} tensors the checkpoint holds")
    want = cfg.expected_shapes()
    if cfg.tie_word_embeddings and "lm_head.weight" in files:
        want["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)  # read it; decided below
    missing = [k for k in want if k not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"{d}: missing tensor {missing[0]!r}{more}")
    extra = sorted(set(files) - set(want))
    if extra:
        raise WeightError(f"{d}: unexpected tensor(s) {', '.join(map(repr, extra[:8]))} "
                          "(not implied by the Mamba2 config)")
    where = {name: (files[name], src[name]) for name in want}
    check_headers(where, want)
    return where


def _load_weights(d: Path, cfg: Mamba2Config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (fp32), every one the config implies, checked first (check_weights)."""
    out = {}
    for name, (file, stored) in check_weights(d, cfg).items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                out[name] = f.get_tensor(stored).to(torch.float32)
        except OSError as e:
            raise WeightError(f"{file}: cannot read ({e})") from None
    if cfg.tie_word_embeddings:
        # As transformers 5: a stored head is served only when it differs from the embedding.
        head = out.get("lm_head.weight")
        emb = out["backbone.embeddings.weight"]
        out["lm_head.weight"] = head if head is not None and not torch.equal(head, emb) else emb
    return out
