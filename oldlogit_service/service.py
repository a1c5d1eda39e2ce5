"""The versioned old-logit service: exact ``pi_old`` per token, or an honest "missing, because ...".

For each sampled token t with version ``v_t`` the service answers ``log pi_old(token | prefix)``
computed with the *learner's* model code and numerics (HF transformers forward +
:func:`modelkit.scoring.sequence_logprobs`, temperature applied the same way) under the weights of
version ``v_t`` - or says per token why it cannot (:class:`protocol.TokenStatus`).

Routes (``route=``):

* ``"snapshot"``: a CPU copy of the weights of every version in ``[V - W, V]`` (``V`` the newest
  published version, ``W`` = ``max_staleness``); older versions are evicted because no token of
  theirs can be consumed any more, and the oldest versions go first when the copies exceed
  ``memory_budget_bytes``. A request costs one forward per distinct *held* version present in it,
  batched over the items that contain that version; each token keeps its own version's value.
* ``"old_logit_model"``: one scorer replica kept in step with every broadcast (newest version
  only). Workers or the driver call :meth:`OldLogitService.attach_old_logprobs` on each
  finished segment before its version is
  superseded, so the :class:`protocol.Trajectory` arrives with ``old_logprobs`` attached.
* ``"interrupt_sync"``: the same single replica; at each weight update the in-flight prefixes are
  scored at the outgoing version (:meth:`OldLogitService.score_prefixes`) *before*
  :meth:`OldLogitService.update_weights` installs the new one; generation then resumes.
* ``"none"``: holds nothing, loads no model; every sampled token is ``MISSING_NEVER_STORED``.

Adapter snapshots (``adapter=`` a :class:`protocol.AdapterSpec`, LoRA training): a version is a
LoRA adapter. The service keeps ONE copy of the base weights (the model folder, frozen in every
version) plus one adapter per held version, and scores the tokens of version v with the model
wrapped by peft (:func:`modelkit.lora.wrap_lora`, the learner's own wrapper) running the base and
v's adapter (a functional call: nothing is merged or copied per forward). The folder's version
is the base with a zero adapter (the learner's ``B`` starts at 0, so its version 0 is the base).
Memory: base bytes once + adapter bytes per version (``rank * (in + out)`` elements per adapted
module), against one full copy per version for full-weight snapshots. Every route works this way.

The KL penalties' frozen reference (``pin_initial``, snapshot route): the folder's version stays
held for the whole run, never evicted (it counts in the memory budget), and a request that names it
(:attr:`protocol.OldLogitRequest.reference_version`) also gets its log-probs of the tokens its
``reference_masks`` mark, by the same forward as an old log-prob, in
:attr:`protocol.OldLogitAnswer.ref_logprobs`: the learner then keeps no frozen copy.

On every route :meth:`OldLogitService.score` answers exact for tokens whose version is held, so the
single-replica routes answer exact only for the loaded version.

Exactness: the forward for version v is the learner's forward (right-padded ``[rows, seq_v]``) of
the request's items that contain v, cut after the last version-v token among them (a causal model
needs no later tokens). A learner forward of that same batch with the same weights gives
bit-identical values (fp32, CPU); a learner that pads or cuts differently differs only by fp32
round-off (observed <= 2e-6 nats on the tiny model), never by a version.

Conventions: versions as in ``docs/architecture.md``; log-probs in nats; ``old_logprobs`` is NaN on
every token that is not ``EXACT`` (context tokens included); bytes are host bytes of the held weight
tensors (tied tensors counted once; with adapters: the base once plus every held adapter); seconds
are wall seconds (``time.perf_counter``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from modelkit.procmem import tree_rss_bytes
from modelkit.scoring import sequence_logprobs
from modelkit.weights import torch_dtype, unpack_weights
from oldlogit_service.intake import already_published, check_shapes, owned_copy
from oldlogit_service.items import as_item, merge_old_logprobs, nan_extended
from oldlogit_service.scoring import BoundModel, count_statuses, score_by_version, validate_items
from oldlogit_service.store import Holding, VersionStore, check_pinned_fits, unique_bytes
from oldlogit_service.template import load_template, peft_named
from protocol import (
    NO_VERSION,
    AdapterSpec,
    OldLogitAnswer,
    OldLogitItem,
    OldLogitRequest,
    OldLogitRoute,
    OldLogitServiceStatus,
    TokenStatus,
    Trajectory,
    WeightManifest,
)


def check_arguments(
    holding: Holding,
    route: str,
    max_staleness: int,
    memory_budget_bytes: int | None,
    initial_version: int | None,
    micro_batch_tokens: int | None,
    pin_initial: bool,
) -> None:
    """Check :class:`OldLogitService`'s arguments (named as there) before anything is loaded.

    Raises:
        ValueError: ``pin_initial`` off the snapshot route or without an ``initial_version``; a
            ``max_staleness`` that is not an int >= 0; ``micro_batch_tokens`` < 1;
            ``memory_budget_bytes`` < 0; ``initial_version`` < 0 (the message names the argument).
    """
    if pin_initial and (holding.window is None or initial_version is None):
        raise ValueError(
            f"pin_initial: needs the snapshot route and an initial_version, got route {route!r}, "
            f"initial_version {initial_version!r}"
        )
    if not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness: must be an int >= 0, got {max_staleness!r}")
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens: must be >= 1 or None, got {micro_batch_tokens}")
    if memory_budget_bytes is not None and memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes: must be >= 0 or None, got {memory_budget_bytes}")
    if initial_version is not None and initial_version < 0:
        raise ValueError(f"initial_version: must be >= 0 or None, got {initial_version}")


def missing_reason(version: int, latest_version: int | None, evicted: Mapping[int, str]) -> TokenStatus:
    """Why a token of ``version`` has no old log-prob: newer than the newest publication
    (``MISSING_FUTURE``), once held and evicted (``MISSING_EVICTED``), or never held
    (``MISSING_NEVER_STORED``, also when nothing was ever published)."""
    if latest_version is None:
        return TokenStatus.MISSING_NEVER_STORED
    if version > latest_version:
        return TokenStatus.MISSING_FUTURE
    return TokenStatus.MISSING_EVICTED if version in evicted else TokenStatus.MISSING_NEVER_STORED


class OldLogitService:
    """Versioned old-logit server (plain class; :data:`oldlogit_service.actor.OldLogitServer` wraps it).

    Args:
        model_path: HF model folder (``modelkit.modelhub.prepare_smollm2()`` / ``make_tiny_model()``);
            gives the architecture and, when ``initial_version`` is not None, the weights of that version.
        route: ``"snapshot" | "old_logit_model" | "interrupt_sync" | "none"``.
        max_staleness: W >= 0; the snapshot route keeps versions ``[V - W, V]``.
        memory_budget_bytes: host bytes the snapshot copies may take (None: unbounded); the oldest
            version is evicted first. Only the snapshot route is bounded by it (the single-replica
            routes hold exactly one copy by construction).
        device: where forwards run (``"cpu"`` default; snapshots stay on the CPU and are moved per forward).
        dtype: ``"float32"`` (default, learner numerics) or ``"bfloat16"`` / ``"float16"``; weights
            are stored and run in it.
        initial_version: version of the folder's weights (default 0: the learner starts from the same
            folder); None holds nothing until the first :meth:`update_weights`.
        adapter: a :class:`protocol.AdapterSpec` (or its dict) when the learner publishes LoRA
            adapters: the folder's weights are kept once as the base and every version is an adapter
            (see the module docstring); publications must then carry this same ``manifest.adapter``.
            None (default): every version is a full copy of the weights.
        packed: pack each forward's right-padded rows into as few rows as hold them, as a learner
            with ``pack_sequences`` does (:mod:`modelkit.scoring`): no compute on padding.
        micro_batch_tokens: most positions (rows x padded length) in one scoring forward; a
            version's rows are scored in consecutive runs under it. None: one forward per version.
        pin_initial: keep the folder's version (``initial_version``) for the whole run, never
            evicted: the frozen reference of the KL penalties, scored beside the old logits when a
            request asks (:attr:`protocol.OldLogitRequest.reference_version`). Snapshot route only.

    Raises:
        ValueError: an unknown route, negative ``max_staleness`` / budget, an unknown dtype,
            ``pin_initial`` off the snapshot route or without ``initial_version``, or a budget that
            cannot hold the pinned copy beside one published version (the message names the
            argument).
    """

    def __init__(
        self,
        model_path: str | Path | None,
        route: OldLogitRoute = "snapshot",
        max_staleness: int = 2,
        memory_budget_bytes: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        initial_version: int | None = 0,
        adapter: AdapterSpec | Mapping[str, Any] | None = None,
        packed: bool = False,
        micro_batch_tokens: int | None = None,
        pin_initial: bool = False,
    ) -> None:
        holding = Holding.of(route, max_staleness)  # raises on an unknown route name
        check_arguments(
            holding, route, max_staleness, memory_budget_bytes, initial_version, micro_batch_tokens, pin_initial
        )
        self.route: str = route
        self.holding = holding
        """How this route holds versions (:class:`oldlogit_service.store.Holding`)."""
        self.max_staleness = max_staleness
        self.memory_budget_bytes = memory_budget_bytes
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        self.packed = packed
        """Pack each forward's rows as the learner does (``learner.pack_sequences``, :mod:`modelkit.scoring`)."""
        self.micro_batch_tokens = micro_batch_tokens
        """Most positions in one scoring forward (:func:`oldlogit_service.scoring.row_chunks`); None: one per version."""
        self._store_device = torch.device("cpu") if self.holding.on_host else self.device
        self.adapter = None if adapter is None else AdapterSpec.from_wire(adapter, "adapter")
        """The adapter spec when versions are LoRA adapters over one kept base, else None."""
        self._base: dict[str, Tensor] = {}  # adapter mode: the base weights, in the wrapped model's names

        self.store = VersionStore()
        """The held weight copies by version, their bytes and the eviction record."""
        self.latest_version: int | None = None
        """Newest version published to the service (held or not)."""

        self.forwards = 0
        """Model forwards run so far (one per distinct held version per request)."""
        self.tokens_exact = 0
        self.tokens_missing: Counter[str] = Counter()
        self.tokens_reference = 0
        """Tokens scored under the pinned reference version (:meth:`score` with ``reference_version``)."""
        self.seconds: Counter[str] = Counter()
        """Wall seconds by kind: ``score``, ``segments``, ``prefixes`` (interruption stall), ``update``."""
        self.requests = 0
        self.last_request_seconds = 0.0
        self.started_unix = time.time()
        """When this service was constructed (Unix seconds): a restarted actor process has a new one."""

        self.model: torch.nn.Module | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.vocab_size = 0
        if not self.holding.weights:
            return
        if model_path is None:
            raise ValueError(f"model_path: required for route {route!r}")
        t = load_template(model_path, self.dtype, self.device, self._store_device, self.adapter)
        self.model, self.vocab_size, self._shapes, self._base = t.model, t.vocab_size, t.shapes, t.base
        self.store.base_bytes = unique_bytes(t.base)
        if initial_version is not None:  # the folder's weights become the first held version
            self.latest_version = initial_version
            self.store.put(initial_version, t.folder_version)
            if pin_initial:
                self.store.pinned.add(initial_version)
                check_pinned_fits(self.store.bytes, self.store.held_bytes[initial_version], memory_budget_bytes)

    # ------------------------------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------------------------------

    @property
    def versions_held(self) -> list[int]:
        """Versions whose weights are held now, ascending."""
        return self.store.versions

    @property
    def bytes_held(self) -> int:
        """Host (or device) bytes of the held weight copies, tied tensors counted once; with
        adapters: the base once plus every held adapter."""
        return self.store.bytes

    @property
    def evicted(self) -> dict[int, str]:
        """Versions once held (or refused by the budget) and gone, with the reason
        (:data:`oldlogit_service.store.EVICT_STALENESS`, ...)."""
        return self.store.evicted

    def update_weights(
        self, manifest: WeightManifest | Mapping[str, Any], payload: Mapping[str, Tensor], verify: bool = True
    ) -> int:
        """Take the weight publication of version ``manifest.version`` (call it on every publication).

        The payload is verified whole (:func:`modelkit.weights.unpack_weights`, once per host for a
        payload from the object store) before any held version is touched, so a bad payload leaves
        the service as it was. Its tensors are copied (cast to the service dtype), except read-only
        object-store views that already have the store's device and dtype: those are immutable and
        are held as they are (Ray keeps the object alive while they are held). Snapshot route:
        versions older than ``V - max_staleness`` are evicted (reason ``staleness``), then the
        oldest until the copies fit the memory budget (reason ``memory_budget``; a version that
        alone exceeds the budget is recorded as evicted at once). Single-replica routes: the new
        version replaces the loaded one (``superseded``). Route ``none``: only the version number is
        recorded. Republishing the newest version with the same checksum is a no-op.

        Args:
            manifest: :class:`protocol.WeightManifest` (or its dict form).
            payload: ``{hf_name: cpu tensor}`` from :func:`modelkit.weights.pack_weights` (tied aliases left out).
            verify: check shapes, byte counts and checksum against the manifest (default True).

        Returns:
            The version now current (``manifest.version``).

        Raises:
            pydantic.ValidationError: a malformed manifest mapping (decoded strictly,
                :meth:`protocol.Message.from_wire`).
            protocol.ProtocolError: the payload does not match the manifest, or its tensor names or
                shapes do not match the model (the message names the tensor).
            ValueError: ``manifest.version`` is older than the newest version already published, or
                republishes it with different weights.

        With :attr:`adapter` set, the publication must be an adapter of that same spec (otherwise
        ``ProtocolError`` naming ``manifest.adapter``); only the adapter is copied and held.
        """
        t0 = time.perf_counter()
        manifest = WeightManifest.from_wire(manifest, "manifest")
        v = manifest.version
        try:
            if already_published(manifest, self.latest_version, self.store, self.holding.weights, self.adapter):
                return v
            if not self.holding.weights:
                self.latest_version = v
                return v
            full = unpack_weights(manifest, payload, verify=verify)
            check_shapes(full, self._shapes)
            self.store.replace(v)  # the folder's copy of this version gives way to the published one
            self.latest_version = v
            new_bytes = sum(math.prod(spec.shape) for spec in manifest.tensors) * self.dtype.itemsize
            if not self.store.make_room(v, new_bytes, self.holding.window, self.memory_budget_bytes):
                return v
            own = owned_copy(manifest, payload, full, self._store_device, self.dtype)
            self.store.put(v, peft_named(own) if self.adapter is not None else own)
            self.store.checksums[v] = manifest.checksum
            self.store.published_names[v] = [spec.name for spec in manifest.tensors]
            return v
        finally:
            self.seconds["update"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------
    # scoring
    # ------------------------------------------------------------------------------------------

    def _missing_reason(self, v: int) -> TokenStatus:
        return missing_reason(v, self.latest_version, self.evicted)

    @torch.no_grad()
    def _forward(self, version: int, ids: Tensor, mask: Tensor, temperature: float) -> Tensor:
        weights = self.store.held[version]
        if self.adapter is not None:  # the kept base with this version's adapter
            weights = {**self._base, **weights}
        if self._store_device != self.device:
            moved: dict[int, Tensor] = {}
            weights = {k: moved.setdefault(id(t), t.to(self.device, non_blocking=True)) for k, t in weights.items()}
        self.forwards += 1
        assert self.model is not None
        return sequence_logprobs(
            BoundModel(self.model, weights), ids.to(self.device), mask.to(self.device), temperature, packed=self.packed
        ).cpu()  # type: ignore[arg-type]

    def _score_items(
        self, items: Sequence[OldLogitItem], temperature: float
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-item ``(old_logprobs [seq] float32, status [seq] int8)`` (:func:`score_by_version`
        with the held versions), counted into the token counters."""
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        validate_items(items, self.vocab_size)
        lps, sts = score_by_version(
            items, self.store.held, lambda v, ids, mask: self._forward(v, ids, mask, temperature), self._missing_reason,
            self.micro_batch_tokens,
        )  # fmt: skip
        exact, missing = count_statuses(sts)
        self.tokens_exact += exact
        self.tokens_missing.update(missing)
        return lps, sts

    def score(self, request: OldLogitRequest | Mapping[str, Any]) -> OldLogitAnswer:
        """Exact old log-probs of each sampled token under its own version, or why not.

        Per item and token: ``EXACT`` with ``log pi_old`` (nats, temperature applied) when the
        token's version is held; ``CONTEXT`` where ``loss_mask`` is 0; otherwise
        ``MISSING_EVICTED`` (held once), ``MISSING_NEVER_STORED`` (never held: skipped, route
        ``none``, or older than the first held version) or ``MISSING_FUTURE`` (newer than any
        published version). ``old_logprobs`` is NaN wherever the status is not ``EXACT``.
        One forward per distinct held version present, over the items containing it.

        Args:
            request: :class:`protocol.OldLogitRequest` (or its dict/JSON-decoded form); each item
                carries ``token_ids``, ``loss_mask`` and ``versions``, all ``[seq]``.

        Returns:
            :class:`protocol.OldLogitAnswer` with per-item ``old_logprobs`` (float32 ``[seq]``) and
            ``status`` (int8 ``[seq]``), and the wall seconds spent.

        Raises:
            pydantic.ValidationError: a malformed request mapping (decoded strictly,
                :meth:`protocol.Message.from_wire`; the message names the field).
            TypeError: ``request`` is neither a request nor a mapping.
            ValueError: ``items[i].token_ids`` outside the vocabulary, or ``items[i].loss_mask``
                marks offset 0 (no prefix to score it with).
        """
        t0 = time.perf_counter()
        request = OldLogitRequest.from_wire(request, "request")
        lps, sts = self._score_items(request.items, request.temperature)
        ref = None
        if request.reference_version is not None:
            ref = self._score_reference(request)
        dt = time.perf_counter() - t0
        self._account("score", dt)
        return OldLogitAnswer(
            request_id=request.request_id, route=self.route, old_logprobs=lps, status=sts, seconds=dt, ref_logprobs=ref
        )

    def _score_reference(self, request: OldLogitRequest) -> list[np.ndarray]:
        """Per item ``[seq]`` float32: log-probs of the tokens ``request.reference_masks`` marks under
        ``request.reference_version`` (NaN elsewhere, and everywhere when that version is not held),
        by the same forward as an old log-prob; counted in ``tokens_reference``, not in the
        old-logit token counters."""
        v = request.reference_version
        items = [
            it.model_copy(update={"loss_mask": m, "versions": np.where(m == 1, v, NO_VERSION).astype(np.int32)})
            for it, m in zip(request.items, request.reference_masks, strict=True)
        ]
        validate_items(items, self.vocab_size)
        lps, sts = score_by_version(
            items, self.store.held, lambda u, ids, mask: self._forward(u, ids, mask, request.temperature),
            self._missing_reason, self.micro_batch_tokens,
        )  # fmt: skip
        self.tokens_reference += count_statuses(sts)[0]
        return [
            np.where(st == TokenStatus.EXACT, lp, np.nan).astype(np.float32) for lp, st in zip(lps, sts, strict=True)
        ]

    def _score_current(
        self, items: Sequence[Any], temperature: float, kind: str, known: Sequence[np.ndarray | None] | None
    ) -> list[np.ndarray]:
        t0 = time.perf_counter()
        its = [as_item(x, i) for i, x in enumerate(items)]
        if known is not None:
            if len(known) != len(its):
                raise ValueError(f"old_logprobs: {len(known)} arrays for {len(its)} items")
            prev = [nan_extended(k, len(it.token_ids), i) for i, (k, it) in enumerate(zip(known, its, strict=True))]
            # tokens that already carry a value are not scored (nor counted) again
            its = [
                it.model_copy(update={"loss_mask": np.where(np.isnan(p), it.loss_mask, 0).astype(np.int8)})
                for it, p in zip(its, prev, strict=True)
            ]
        lps, _ = self._score_items(its, temperature)
        if known is not None:
            lps = [merge_old_logprobs(p, lp) for p, lp in zip(prev, lps, strict=True)]
        self._account(kind, time.perf_counter() - t0)
        return lps

    def score_prefixes(
        self,
        items: Sequence[OldLogitItem | Trajectory],
        temperature: float,
        old_logprobs: Sequence[np.ndarray | None] | None = None,
    ) -> list[np.ndarray]:
        """interrupt_sync route: score interrupted in-flight prefixes at the outgoing version.

        The update protocol is: workers interrupt and send their prefixes (token ids, loss mask,
        versions of each token); the service scores them with this method while it still holds
        the outgoing version; then :meth:`update_weights` installs the new version and generation
        resumes (continue, not restart). Tokens of earlier versions in a prefix were scored at
        earlier interruptions: pass what the sequence carries so far as ``old_logprobs`` and they
        are kept (not rescored); the answer is the merged ``[seq]`` array. The time spent is the
        interruption stall (``stats()["seconds"]["prefixes"]``).

        The same scoring serves finished segments on the old_logit_model route (tokens of the loaded
        version exact, every other token NaN and counted missing with its reason, a superseded
        version as evicted); :meth:`attach_old_logprobs` wraps it for trajectories.

        Args:
            items: :class:`protocol.OldLogitItem` / :class:`protocol.Trajectory` objects (or item
                dicts), ``[seq]`` each.
            temperature: the sampling temperature (> 0).
            old_logprobs: optional, per item, the values attached so far (``[seq']``, seq' <= seq,
                NaN where missing; None for none). Finite positions are kept and not scored again;
                the rest of the item is scored.

        Returns:
            One float32 ``[seq]`` array per item: nats, NaN where not exact (merged with
            ``old_logprobs`` when given).

        Raises:
            TypeError: an item of another type (``items[i]``).
            ValueError: as :meth:`score` (field named ``items[i]...``), temperature <= 0, or
                ``old_logprobs`` of the wrong count or longer than its item.
        """
        return self._score_current(items, temperature, "prefixes", old_logprobs)

    def attach_old_logprobs(self, trajectories: Sequence[Trajectory], temperature: float) -> list[Trajectory]:
        """Score ``trajectories`` at the loaded version and return copies carrying ``old_logprobs``.

        Values already attached (earlier segments, earlier interruptions) are kept; only NaN
        positions are filled. Shapes: ``old_logprobs`` ``[seq]`` float32, NaN where not exact.

        Raises:
            TypeError: an element is not a :class:`protocol.Trajectory`.
        """
        for i, t in enumerate(trajectories):
            if not isinstance(t, Trajectory):
                raise TypeError(f"trajectories[{i}]: expected Trajectory, got {type(t).__name__}")
        new = self._score_current(trajectories, temperature, "segments", [t.old_logprobs for t in trajectories])
        return [t.with_old_logprobs(lp) for t, lp in zip(trajectories, new, strict=True)]

    # ------------------------------------------------------------------------------------------
    # accounting
    # ------------------------------------------------------------------------------------------

    def _account(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.requests += 1
        self.last_request_seconds = seconds

    def fingerprint(self) -> dict[str, Any]:
        """``{"version", "served"}``: the newest published version and the fingerprint
        (:mod:`modelkit.fingerprint`, in the service dtype) of its tensors as held here - the ones
        its forwards run with - over the names its publication carried (an adapter's factors with
        adapters); ``served`` None when that version is not held or came from the folder."""
        from modelkit.fingerprint import weights_fingerprint
        from modelkit.lora import adapter_to_peft

        v = self.latest_version
        held = self.store.held
        names = self.store.published_names.get(v) if v in held else None
        if names is None:
            return {"version": v, "served": None}
        key = adapter_to_peft if self.adapter is not None else str
        return {"version": v, "served": weights_fingerprint({n: held[v][key(n)] for n in names})}

    def status(self) -> OldLogitServiceStatus:
        """Versions and bytes held, exact/missing token counts (by reason), seconds, requests and start time."""
        return OldLogitServiceStatus(
            route=self.route,  # type: ignore[arg-type]
            versions_held=self.versions_held,
            bytes_held=self.bytes_held,
            tokens_exact=self.tokens_exact,
            tokens_missing=dict(self.tokens_missing),
            seconds_total=float(sum(self.seconds.values())),
            requests=self.requests,
            started_unix=self.started_unix,
            rss_bytes=tree_rss_bytes(),
        )

    def stats(self) -> dict[str, Any]:
        """:meth:`status` fields plus ``forwards``, ``base_bytes`` (the kept base with adapters, else
        0), ``adapter`` (the spec or None), ``latest_version``, ``evicted`` ({version:
        reason}), ``evictions`` (count by reason), ``seconds`` (by kind), ``seconds_per_request``
        (mean over score/segment/prefix calls), ``last_request_seconds`` and ``exact_token_fraction``."""
        out = self.status().model_dump()
        scored = self.seconds["score"] + self.seconds["segments"] + self.seconds["prefixes"]
        seen = self.tokens_exact + sum(self.tokens_missing.values())
        out.update(
            forwards=self.forwards,
            base_bytes=self.store.base_bytes,
            adapter=self.adapter.model_dump() if self.adapter is not None else None,
            latest_version=self.latest_version,
            evicted=dict(self.evicted),
            evictions=dict(self.store.evictions),
            seconds=dict(self.seconds),
            seconds_per_request=scored / self.requests if self.requests else 0.0,
            last_request_seconds=self.last_request_seconds,
            exact_token_fraction=self.tokens_exact / seen if seen else 1.0,
        )
        return out
