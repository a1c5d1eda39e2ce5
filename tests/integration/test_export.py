"""``vintage export`` round trip on the tiny random Llama: a real learner trains two versions and
checkpoints them as the job does, the export of one of them loads in plain transformers (or peft),
and its log-probs of fixed tokens equal the learner's at that version.

Tolerances: exact (0.0) in fp32 for full weights (every ZeRO stage) and for the peft adapter; the
merged LoRA model computes ``(W0 + s B A) x`` where the learner computes ``W0 x + s B (A x)``, so
it is within fp32 rounding of it (``MERGED_ATOL``); bf16 learner weights are saved exactly as the
learner holds them and give the same log-probs (measured: 0.0).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from modelkit.scoring import sequence_logprobs
from tests.export_run import TEMPERATURE, fixed_tokens, trained_run, trajectory_maker
from trainer.driver.records.export import RECORD_FILE, export_run

pytestmark = pytest.mark.integration

MERGED_ATOL = 1e-5  # fp32 rounding of one merged matmul vs two (measured: 9.5e-7 nats)


@pytest.fixture(scope="module")
def make_trajs(tiny_model_path):
    return trajectory_maker(tiny_model_path)


def exported_logprobs(model, make_trajs, version: int) -> torch.Tensor:
    b = fixed_tokens(make_trajs, version)
    with torch.no_grad():
        return sequence_logprobs(model.eval(), b.token_ids, b.attention_mask, TEMPERATURE).float()


@pytest.mark.parametrize("stage,dtype", [(0, "float32"), (3, "float32"), (2, "bfloat16")])
def test_full_weights_export_loads_in_transformers_with_the_learners_logprobs(
    tiny_model_path, make_trajs, tmp_path, stage, dtype
):
    run_dir, core, learner_lp = trained_run(
        tmp_path, make_trajs, f"learner.zero_stage={stage}", f'learner.dtype="{dtype}"', "learner.lr=1e-3"
    )
    out = tmp_path / "export-v1"
    record = export_run(run_dir, out, version=1)  # not the latest: version 2 is
    assert record.kind == "full" and record.version == 1 and record.dtype == dtype and record.zero_stage == stage
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", RECORD_FILE} <= {
        p.name for p in out.iterdir()
    }
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # tied: stored once, as save_pretrained does
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == getattr(torch, dtype) and model.lm_head.weight is model.model.embed_tokens.weight
    got = exported_logprobs(model, make_trajs, 1)
    diff = float((got - learner_lp[1]).abs().max())
    assert diff == 0.0, f"max abs log-prob difference {diff}"
    assert float((got - learner_lp[2]).abs().max()) > 1e-4  # version 1, not the latest
    # the base folder's generation config and tokenizer travel with it
    base_gen = json.loads((tiny_model_path / "generation_config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert {k: gen[k] for k in base_gen if k != "transformers_version"} == {
        k: v for k, v in base_gen.items() if k != "transformers_version"
    }
    tok, base_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_path)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(chat, tokenize=False) == base_tok.apply_chat_template(chat, tokenize=False)
    assert tok("a tokenizer round trip")["input_ids"] == base_tok("a tokenizer round trip")["input_ids"]
    rec = json.loads((out / RECORD_FILE).read_text())
    assert rec["version"] == 1 and rec["temperature"] == TEMPERATURE and rec["base_model"] == str(tiny_model_path)
    if stage == 0:  # the latest version through the command line, over the first export
        from typer.testing import CliRunner

        from vintage_cli.main import app

        r = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(out)])
        assert r.exit_code == 2 and "--out" in r.output and "not empty" in r.output
        r = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(out), "--overwrite"])
        assert r.exit_code == 0, r.output
        assert "exported version 2" in r.output
        got2 = exported_logprobs(AutoModelForCausalLM.from_pretrained(out), make_trajs, 2)
        assert float((got2 - learner_lp[2]).abs().max()) == 0.0


def test_lora_export_is_a_peft_adapter_and_merges_into_the_learners_weights(tiny_model_path, make_trajs, tmp_path):
    from peft import PeftModel

    run_dir, core, learner_lp = trained_run(
        tmp_path, make_trajs, "lora.enabled=true", "lora.rank=4", "lora.alpha=8.0", "learner.lr=1e-2"
    )
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    rec = export_run(run_dir, adapter_dir, version=2)
    targets = list(core.settings.lora.target_modules)
    assert rec.kind == "adapter" and rec.lora == {"rank": 4, "alpha": 8.0, "target_modules": targets}
    files = {p.name for p in adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", RECORD_FILE} <= files
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and conf["base_model_name_or_path"] == str(tiny_model_path)
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert saved.keys() == core.adapter_state().keys()
    assert all(torch.equal(saved[k], v) for k, v in core.adapter_state().items())
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), adapter_dir)
    diff = float((exported_logprobs(peft_model, make_trajs, 2) - learner_lp[2]).abs().max())
    assert diff == 0.0, f"peft adapter: max abs log-prob difference {diff}"

    rec = export_run(run_dir, merged_dir, version=2, merge=True)
    assert rec.kind == "merged" and not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    full = core.state_dict_full()  # the weights a rollout worker runs at version 2
    assert all(torch.equal(merged.state_dict()[k], full[k]) for k in full)
    diff = float((exported_logprobs(merged, make_trajs, 2) - learner_lp[2]).abs().max())
    assert diff < MERGED_ATOL, f"merged: max abs log-prob difference {diff}"
