"""One batched Mamba2 forward over a ragged step: chunk jobs and decode jobs together.

A chunk job is a run of tokens starting at a chunk boundary b of its
sequence, from that sequence's canonical state at b. Its tokens are laid out
in chunks of exactly L rows at absolute positions b, b+L, ... (the last one
zero-padded), so every chunk of every job is the same fixed-shape
computation wherever and with whatever else it runs. A decode job is one
token through the recurrent update from a given state.

Per layer, every real token of the step (chunk and decode alike) goes
through one invariant projection; the conv of all chunks is one call (a
chunk's left context is the previous chunk's last K-1 inputs, or the
canonical conv state for a job's first chunk); the SSD scan runs in waves,
wave w being the w-th chunk of every job that has one (its initial state is
the job's previous chunk's end state); decode rows take causal_conv with
L = 1 and ssm_update. A decode job may start from a chunk job's end state
in the same step (a live state rebuilt from b): chunk work of a layer runs
before its decode work.

Bitwise batch invariance holds because every op is one of: a row-invariant
linear (kernels/linear.py), an elementwise op whose result does not depend
on its position in the tensor (no F.silu / F.softplus / log1p: their CPU
kernels round a vector body and a scalar tail differently), a reduction over
a contiguous last dim of fixed size, or a per-row fixed-shape SSD kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

import torch

from superfluid.engine.mamba2 import Mamba2Config
from superfluid.kernels.linear import linear as _linear
from superfluid.kernels.ssd import silu


@dataclasses.dataclass
class ChunkJob:
    slot: int
    tokens: list[int]  # from the boundary on


@dataclasses.dataclass
class DecodeJob:
    slot: int
    token: int
    source: str | int  # "live", "canon" (no tokens since b), or the index of a chunk job that rebuilds it


@dataclasses.dataclass
class StepOut:
    logits: torch.Tensor | None                  # [rows, vocab]
    # conv, ssm states, layer-major [layers, n, ...]:
    boundary: tuple[torch.Tensor, torch.Tensor]  # at the last boundary of each chunk job with a full chunk
    end: tuple[torch.Tensor, torch.Tensor]       # after each chunk job's last token
    decoded: tuple[torch.Tensor, torch.Tensor]   # after each decode job's token


def _cpu_kernels() -> bool:
    import os

    if os.environ.get("SUPERFLUID_CPU_KERNELS", "1") == "0":
        return False
    from superfluid.kernels import cpu

    return cpu.available()


def softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus (threshold 20) from position-independent ops: log1p(u) as
    log(v) * u / (v - 1), v = 1 + u (exact to a few ulp, no tail rounding)."""
    u = torch.exp(x)
    v = 1 + u
    l1p = torch.where(v == 1, u, torch.log(v) * (u / (v - 1)))
    return torch.where(x > 20, x, l1p)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Mamba2Forward:
    """The weights on their device and the step forward over them."""

    def __init__(self, cfg: Mamba2Config, weights: dict[str, torch.Tensor], kernels: ModuleType,
                 device: torch.device, chunk: int):
        if chunk < cfg.conv_kernel - 1:
            raise ValueError(f"chunk length {chunk} is shorter than the conv's context "
                             f"({cfg.conv_kernel - 1} tokens)")
        self.cfg, self.k, self.device, self.L = cfg, kernels, device, chunk

        def get(name):
            t = weights.get(name)
            return None if t is None else t.to(device=device, dtype=torch.float32).contiguous()

        self.emb = get("backbone.embeddings.weight")
        self.norm_f = get("backbone.norm_f.weight")
        # A tied head is the embedding itself (mamba2._load_weights hands back the same tensor).
        tied = weights["lm_head.weight"] is weights["backbone.embeddings.weight"]
        self.head = self.emb if tied else get("lm_head.weight")
        self.layers = []
        for l in range(cfg.num_layers):
            p = f"backbone.layers.{l}."
            m = p + "mixer."
            self.layers.append(dict(
                norm=get(p + "norm.weight"), in_w=get(m + "in_proj.weight"), in_b=get(m + "in_proj.bias"),
                conv_w=get(m + "conv1d.weight")[:, 0, :].contiguous(), conv_b=get(m + "conv1d.bias"),
                dt_bias=get(m + "dt_bias"), A=-torch.exp(get(m + "A_log")), D=get(m + "D"),
                gnorm=get(m + "norm.weight"), out_w=get(m + "out_proj.weight"),
                out_b=get(m + "out_proj.bias")))
        self.weight_bytes = sum(t.numel() * 4 for t in {id(t): t for t in weights.values()}.values())
        self.head_packed = None
        if device.type == "cpu" and _cpu_kernels():
            # The transformer's C GEMM (kernels/cpu.py): as row-invariant as kernels/linear.py
            # (a thread takes whole output panels, never part of a reduction) and faster at
            # decode widths than torch's GEMM on padded tokens. The packed copy replaces the
            # weight (a tied head keeps the embedding, which embeds).
            from superfluid.kernels import cpu

            self._cpu = cpu
            for w in self.layers:
                for kind in ("in", "out"):
                    w[kind + "_p"] = cpu.pack(w.pop(kind + "_w"), w[kind + "_b"])
            self.head_packed = cpu.pack(self.head)
            if not tied:
                self.head = None

    def _linear(self, x: torch.Tensor, w: dict, kind: str) -> torch.Tensor:
        """The in_proj or out_proj of layer weights w."""
        p = w.get(kind + "_p")
        if p is not None:
            return self._cpu.linear(x.contiguous(), p)
        return _linear(x, w[kind + "_w"], w[kind + "_b"])

    def __call__(self, chunk_jobs: list[ChunkJob], decode_jobs: list[DecodeJob], rows: list[tuple[str, int]],
                 pool) -> StepOut:
        """rows: ("c", j) the last token of chunk job j, ("d", i) decode job i."""
        cfg = self.cfg
        lay = _Layout(chunk_jobs, decode_jobs, self.L, self.device)
        nl, K1, D = cfg.num_layers, cfg.conv_kernel - 1, cfg.conv_dim
        ssm = (cfg.num_heads, cfg.head_dim, cfg.state_size)
        empty = functools.partial(torch.empty, device=self.device)
        # The states a step leaves, layer-major (pool.write's layout), written a layer at a time.
        out = StepOut(None, (empty((nl, lay.n_full, K1, D)), empty((nl, lay.n_full, *ssm))),
                      (empty((nl, len(chunk_jobs), K1, D)), empty((nl, len(chunk_jobs), *ssm))),
                      (empty((nl, lay.Td, K1, D)), empty((nl, lay.Td, *ssm))))
        I, H = cfg.intermediate_size, cfg.num_heads
        with torch.no_grad():
            hid = self.emb[lay.tokens]
            for l, w in enumerate(self.layers):
                zxbcdt = self._linear(rmsnorm(hid, w["norm"], cfg.eps), w, "in")
                z, xbc, dtr = zxbcdt.split([I, D, H], dim=-1)
                y, xs = empty((lay.Tc + lay.Td, I)), empty((lay.Tc + lay.Td, I))
                ends = None
                if lay.Tc:
                    ends = self._chunks(l, w, xbc[:lay.Tc], dtr[:lay.Tc], lay, pool, out, y, xs)
                if lay.Td:
                    self._decodes(l, w, xbc[lay.Tc:], dtr[lay.Tc:], lay, pool, out, y, xs, ends)
                # D skip, then the gated RMSNorm per group, then out_proj and the residual.
                y = (y.view(-1, H, cfg.head_dim) + w["D"][:, None] * xs.view(-1, H, cfg.head_dim)).view(-1, I)
                g = (y * silu(z)).view(-1, cfg.n_groups, I // cfg.n_groups)
                g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + cfg.eps)).view(-1, I)
                hid = hid + self._linear(w["gnorm"] * g, w, "out")
            if rows:
                at = lay.index([lay.job_end[i] if kind == "c" else lay.Tc + i for kind, i in rows])
                last = rmsnorm(hid[at], self.norm_f, cfg.eps)
                out.logits = (self._cpu.linear(last.contiguous(), self.head_packed) if self.head_packed is not None
                              else _linear(last, self.head))
        return out

    def _chunks(self, l, w, xbc, dtr, lay: _Layout, pool, out: StepOut, y, xs):
        """Layer l of every chunk job: y and x of its real tokens, its end and boundary states.
        Returns the conv and SSM end state of every grid row (decode jobs may start from one)."""
        cfg, L, n = self.cfg, self.L, lay.n_grid
        K1, D, H, P, G, S = (cfg.conv_kernel - 1, cfg.conv_dim, cfg.num_heads, cfg.head_dim, cfg.n_groups,
                             cfg.state_size)
        I = cfg.intermediate_size
        zeros = functools.partial(torch.zeros, device=self.device)
        # The conv of every chunk at once: a job's first chunk continues its canonical conv
        # state, a later one the previous chunk's last K-1 inputs.
        xg = zeros((n * L, D))
        xg[lay.grid_pos] = xbc
        xg = xg.view(n, L, D)
        st = torch.empty((n, K1, D), device=self.device)
        st[lay.first] = pool.canon_conv[l].index_select(0, lay.c_slots)
        st[lay.rest] = xg[lay.rest - 1, L - K1:]
        co, c_end = self.k.causal_conv(xg, st, w["conv_w"], w["conv_b"], lay.lengths)
        co = co * lay.valid  # the scan wants x = B = C = 0 past the real tokens
        x, B, C = co.split([I, G * S, G * S], dim=-1)
        x = x.reshape(n, L, H, P)
        B, C = B.reshape(n, L, G, S), C.reshape(n, L, G, S)
        dt = zeros((n * L, H))
        dt[lay.grid_pos] = softplus(dtr + w["dt_bias"]).clamp(*cfg.time_step_limit)
        dt = dt.view(n, L, H)
        # The scan in waves: wave k is the k-th chunk of every job that has one.
        yg = torch.empty((n, L, H, P), device=self.device)
        h_end = torch.empty((n, H, P, S), device=self.device)
        h0 = pool.canon_ssm[l].index_select(0, lay.c_slots)
        for k, wv in enumerate(lay.waves):
            if k:
                h0 = h_end[wv - 1]
            yg[wv], h_end[wv] = self.k.ssd_chunk(x[wv].contiguous(), dt[wv].contiguous(), w["A"],
                                                 B[wv].contiguous(), C[wv].contiguous(), h0.contiguous())
        y[:lay.Tc] = yg.view(n * L, I)[lay.grid_pos]
        xs[:lay.Tc] = x.reshape(n * L, I)[lay.grid_pos]
        torch.index_select(c_end, 0, lay.last_rows, out=out.end[0][l])
        torch.index_select(h_end, 0, lay.last_rows, out=out.end[1][l])
        if lay.n_full:
            torch.index_select(c_end, 0, lay.full_rows, out=out.boundary[0][l])
            torch.index_select(h_end, 0, lay.full_rows, out=out.boundary[1][l])
        return c_end, h_end

    def _decodes(self, l, w, xbc, dtr, lay: _Layout, pool, out: StepOut, y, xs, ends):
        """Layer l of every decode job, its state updated in place in out.decoded."""
        cfg, Td = self.cfg, lay.Td
        H, P, G, S, I = cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size, cfg.intermediate_size
        cs, hs = out.decoded[0][l], out.decoded[1][l]  # the starting states first
        if lay.all_live:  # the usual decode round: one gather, in order
            torch.index_select(pool.live_conv[l], 0, lay.d_slots, out=cs)
            torch.index_select(pool.live_ssm[l], 0, lay.d_slots, out=hs)
        else:
            for rows, pc, ps in ((lay.from_live, pool.live_conv, pool.live_ssm),
                                 (lay.from_canon, pool.canon_conv, pool.canon_ssm)):
                if rows.numel():
                    cs[rows], hs[rows] = pc[l][lay.d_slots[rows]], ps[l][lay.d_slots[rows]]
            if lay.from_built.numel():
                cs[lay.from_built], hs[lay.from_built] = ends[0][lay.built_rows], ends[1][lay.built_rows]
        co, new_conv = self.k.causal_conv(xbc[:, None, :].contiguous(), cs, w["conv_w"], w["conv_b"])
        cs.copy_(new_conv)
        x, B, C = co[:, 0].split([I, G * S, G * S], dim=-1)
        x = x.reshape(Td, H, P).contiguous()
        dt = softplus(dtr + w["dt_bias"]).contiguous()  # no time_step_limit on one token, as HF
        B, C = B.reshape(Td, G, S).contiguous(), C.reshape(Td, G, S).contiguous()
        yd = self.k.ssm_update(x, dt, w["A"], B, C, hs)
        y[lay.Tc:] = yd.reshape(Td, I)
        xs[lay.Tc:] = x.reshape(Td, I)


class _Layout:
    """Where a step's tokens sit: chunk jobs' real tokens first (token order), then one row
    per decode job; each chunk job's tokens also on a grid of L-row chunks (grid rows of a
    job consecutive), and the index tensors the layers gather and scatter with."""

    def __init__(self, chunk_jobs: list[ChunkJob], decode_jobs: list[DecodeJob], L: int, device):
        self.device = device
        grid_pos, first, lengths, waves, last, full, job_end = [], [], [], [], [], [], []
        n = at = 0
        for j in chunk_jobs:
            m, nch = len(j.tokens), -(-len(j.tokens) // L)
            grid_pos += range(n * L, n * L + m)
            for c in range(nch):
                first.append(c == 0)
                lengths.append(min(L, m - c * L))
                if len(waves) <= c:
                    waves.append([])
                waves[c].append(n + c)
            last.append(n + nch - 1)
            if m >= L:
                full.append(n + m // L - 1)  # the chunk ending at the job's new boundary
            n += nch
            at += m
            job_end.append(at - 1)
        self.n_grid, self.Tc, self.Td, self.n_full = n, len(grid_pos), len(decode_jobs), len(full)
        self.job_end = job_end
        self.tokens = self.index([t for j in chunk_jobs for t in j.tokens] + [d.token for d in decode_jobs])
        self.grid_pos, self.lengths = self.index(grid_pos), self.index(lengths)
        is_first = torch.tensor(first, dtype=torch.bool, device=device)
        self.first, self.rest = is_first.nonzero()[:, 0], (~is_first).nonzero()[:, 0]
        self.valid = torch.zeros(n * L, 1, device=device)
        self.valid[self.grid_pos] = 1.0
        self.valid = self.valid.view(n, L, 1)
        self.waves = [self.index(w) for w in waves]
        self.last_rows, self.full_rows = self.index(last), self.index(full)
        self.c_slots = self.index([j.slot for j in chunk_jobs])
        self.d_slots = self.index([d.slot for d in decode_jobs])
        src = [d.source for d in decode_jobs]
        self.all_live = all(s == "live" for s in src)
        self.from_live = self.index([i for i, s in enumerate(src) if s == "live"])
        self.from_canon = self.index([i for i, s in enumerate(src) if s == "canon"])
        self.from_built = self.index([i for i, s in enumerate(src) if isinstance(s, int)])
        self.built_rows = self.index([last[s] for s in src if isinstance(s, int)])

    def index(self, values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)
