"""``samples.jsonl``: records of hand-made trajectories checked against hand values (trained spans,
per-token versions, exact flags from the old-logit answer, GRPO advantages), the per-step and total
bounds, a resumed run's count, decoding with the run's own tokenizer; and ``vintage samples``
printing them (the text, the trained tokens' styles, ``--version``, ``--limit``, one-line errors)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from protocol import OldLogitAnswer, TokenStatus, Trajectory
from trainer.driver.config.schema import load_config
from trainer.driver.records.samples import SamplesLog, learner_batch, mask_spans, read_samples, sample_record
from vintage_cli.main import app, sample_text

WORDS = {i: f"w{i} " for i in range(100)}


class Words:
    """A stand-in tokenizer: token ``i`` reads ``"w<i> "``."""

    def decode(self, token_ids):
        return "".join(WORDS[i] for i in token_ids)


class NoTokenizer:
    def decode(self, token_ids):
        raise AssertionError("the tokenizer is not needed when nothing is written")


def traj(tid, gid, reward, mask, versions, n_prompt=2, old=None):
    """Token ids 10, 11, ...; ``versions`` for the sampled (mask 1) tokens in order."""
    it = iter(versions)
    ver = [next(it) if m else -1 for m in mask]
    return Trajectory(
        trajectory_id=tid, group_id=gid, token_ids=np.arange(10, 10 + len(mask)), loss_mask=np.array(mask, np.int8),
        behav_logprobs=np.array([-0.5 if m else 0.0 for m in mask], np.float32), versions=np.array(ver),
        prompt_len=n_prompt, policy_version=max(versions), finish_reason="stop", reward=reward, old_logprobs=old,
    )  # fmt: skip


def batch4():
    """Group a: rewards 1, 0 (advantages +1, -1); group b: rewards 0, 0, 3 (mean 1, population
    std sqrt(2): advantages -1/sqrt(2), -1/sqrt(2), sqrt(2)). The first has a tool-output token at 4."""
    return [
        traj("a0", "a", 1.0, [0, 0, 1, 1, 0, 1, 1], (0, 0, 1, 1)),
        traj("a1", "a", 0.0, [0, 0, 1, 1, 1], (1, 1, 1)),
        traj("b0", "b", 0.0, [0, 0, 1, 1], (1, 1)),
        traj("b1", "b", 0.0, [0, 0, 1, 1], (1, 1)),
        traj("b2", "b", 3.0, [0, 0, 1, 1], (1, 1)),
    ]


def answer_for(trajs, exact_below):
    """A snapshot answer: exact on sampled tokens of versions < ``exact_below``, evicted on the others."""
    lps, sts = [], []
    for t in trajs:
        sampled = t.loss_mask.astype(bool)
        ok = sampled & (t.versions < exact_below)
        lps.append(np.where(ok, -0.25, np.nan).astype(np.float32))
        st = np.where(sampled, TokenStatus.MISSING_EVICTED, TokenStatus.CONTEXT)
        sts.append(np.where(ok, TokenStatus.EXACT, st).astype(np.int8))
    return OldLogitAnswer(request_id="r", route="snapshot", old_logprobs=lps, status=sts, seconds=0.0)


def test_mask_spans_are_runs_of_trained_tokens():
    assert mask_spans(np.array([0, 1, 1, 0, 1], bool)) == [[1, 3], [4, 5]]
    assert mask_spans(np.array([1, 1], bool)) == [[0, 2]]
    assert mask_spans(np.zeros(3, bool)) == []


def test_record_against_hand_values():
    cfg = load_config()
    trajs = batch4()
    batch = learner_batch(cfg, trajs, 2, answer_for(trajs, exact_below=1))
    rec = sample_record(trajs[0], batch, 0, Words(), step=3)
    assert (rec["step"], rec["consumed_version"], rec["applied"]) == (3, 2, True)
    assert (rec["trajectory_id"], rec["group_id"], rec["reward"], rec["finish_reason"]) == ("a0", "a", 1.0, "stop")
    assert rec["advantage"] == pytest.approx(1.0)
    assert rec["prompt_len"] == 2 and rec["prompt"] == "w10 w11 "
    assert rec["completion"] == "w12 w13 w14 w15 w16 "
    assert rec["token_ids"] == [10, 11, 12, 13, 14, 15, 16]
    assert rec["versions"] == [-1, -1, 0, 0, -1, 1, 1]
    assert rec["exact"] == [0, 0, 1, 1, 0, 0, 0]  # version 0 held by the service; version 1 evicted: proxy
    assert rec["spans"] == [[2, 4], [5, 7]]  # the tool-output token at 4 is not trained
    assert rec["segments"] == [
        {"start": 2, "end": 4, "text": "w12 w13 ", "trained": True, "exact": True, "version": 0},
        {"start": 4, "end": 5, "text": "w14 ", "trained": False, "exact": False, "version": -1},
        {"start": 5, "end": 7, "text": "w15 w16 ", "trained": True, "exact": False, "version": 1},
    ]
    advantages = [sample_record(t, batch, i, Words(), step=3)["advantage"] for i, t in enumerate(trajs)]
    r2 = math.sqrt(2)
    assert advantages == pytest.approx([1.0, -1.0, -1 / r2, -1 / r2, r2])


def test_stale_tokens_leave_the_spans_and_attached_old_logprobs_count_as_exact():
    cfg = load_config(None, ["controller.max_token_staleness=1"])
    old = np.array([np.nan, np.nan, -0.1, -0.1, np.nan, -0.2, np.nan], np.float32)  # a scorer route attached these
    trajs = [traj("a0", "a", 1.0, [0, 0, 1, 1, 0, 1, 1], (0, 0, 1, 1), old=old), traj("a1", "a", 0.0, [0, 0, 1], (1,))]
    batch = learner_batch(cfg, trajs, 2, None)
    rec = sample_record(trajs[0], batch, 0, Words(), step=3)
    assert rec["spans"] == [[5, 7]]  # version 0 at consuming version 2 is over max_token_staleness = 1
    assert rec["exact"] == [0, 0, 0, 0, 0, 1, 0]  # exact only where trained and attached
    assert rec["versions"] == [-1, -1, 0, 0, -1, 1, 1]  # stale tokens keep their versions (context)
    assert rec["advantage"] == pytest.approx(1.0)


def test_zero_variance_group_and_reinforce_follow_the_configured_estimator():
    trajs = [traj("a0", "a", 0.35, [0, 1, 1], (0, 0), n_prompt=1), traj("a1", "a", 0.35, [0, 1, 1], (0, 0), n_prompt=1)]
    grpo = learner_batch(load_config(), trajs, 0, None)
    assert sample_record(trajs[0], grpo, 0, Words(), step=1)["advantage"] == 0.0
    rf = learner_batch(load_config(None, ['loss.advantage="reinforce"']), trajs, 0, None)
    assert sample_record(trajs[0], rf, 0, Words(), step=1)["advantage"] == pytest.approx(0.35)


def test_bounds_per_step_and_over_the_run_and_a_resumed_count(tmp_path):
    cfg, trajs = load_config(), batch4()
    learned = {"consumed_version": 2, "applied": 1.0}
    log = SamplesLog(tmp_path, per_step=2, max_samples=3, tokenizer=Words())
    assert log.write(cfg, trajs, learned, None, step=1) == 2
    assert log.write(cfg, trajs, learned, None, step=2) == 1  # the run's cap
    assert log.write(cfg, trajs, learned, None, step=3) == 0
    recs = read_samples(tmp_path)
    assert [(r["step"], r["trajectory_id"]) for r in recs] == [(1, "a0"), (1, "a1"), (2, "a0")]
    resumed = SamplesLog(tmp_path, per_step=2, max_samples=3, tokenizer=NoTokenizer())
    assert resumed.written == 3 and resumed.write(cfg, trajs, learned, None, step=4) == 0
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize(("per_step", "max_samples"), [(0, 10), (2, 0)])
def test_zero_disables_and_loads_no_tokenizer(tmp_path, per_step, max_samples):
    log = SamplesLog(tmp_path, per_step=per_step, max_samples=max_samples, model_path=tmp_path / "no-model")
    assert log.write(load_config(), batch4(), {"consumed_version": 2, "applied": 1.0}, None, step=1) == 0
    assert not (tmp_path / "samples.jsonl").exists() and log._tokenizer is None


def test_a_missing_file_names_the_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no samples.jsonl"):
        read_samples(tmp_path)


def test_decoded_with_the_run_tokenizer(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    prompt, reply = tok("Count: ")["input_ids"], tok("one two three")["input_ids"]
    ids = prompt + reply
    mask = [0] * len(prompt) + [1] * len(reply)
    t = Trajectory(
        trajectory_id="t", group_id="g", token_ids=np.array(ids), loss_mask=np.array(mask, np.int8),
        behav_logprobs=np.array([-0.5 if m else 0.0 for m in mask], np.float32),
        versions=np.array([0 if m else -1 for m in mask]), prompt_len=len(prompt), policy_version=0,
        finish_reason="stop", reward=1.0,
    )  # fmt: skip
    log = SamplesLog(tmp_path, per_step=2, max_samples=10, model_path=tiny_model_path)
    assert log.write(load_config(), [t], {"consumed_version": 0, "applied": 1.0}, None, step=1) == 1
    (rec,) = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rec["prompt"] == "Count: " and rec["completion"] == "one two three"
    assert rec["segments"][0]["text"] == "one two three" and rec["spans"] == [[len(prompt), len(ids)]]


# -- vintage samples ---------------------------------------------------------------------------


def run_dir(tmp_path):
    """Two steps of two records each: step 3 trained at version 2, step 4 at version 3."""
    trajs = batch4()
    log = SamplesLog(tmp_path, per_step=2, max_samples=10, tokenizer=Words())
    log.write(load_config(), trajs, {"consumed_version": 2, "applied": 1.0}, answer_for(trajs, 1), step=3)
    log.write(load_config(), trajs, {"consumed_version": 3, "applied": 0.0}, None, step=4)
    return tmp_path


def samples(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["samples", *args])
    return r.exit_code, r.output


def test_prints_the_records_of_a_version(tmp_path):
    code, out = samples(str(run_dir(tmp_path)), "--version", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "trained, exact pi_old  trained, proxy  not trained"
    assert "step 3  trained at version 2  a0 (group a)  reward 1  advantage +1  finish stop" in lines
    assert "sampled at versions 0-1  trained tokens 4 (exact 2, proxy 2)  spans [[2, 4], [5, 7]]" in lines
    assert "prompt: w10 w11 " in lines and "completion: w12 w13 w14 w15 w16 " in lines
    assert "step 3  trained at version 2  a1 (group a)  reward 0  advantage -1  finish stop" in lines
    assert "sampled at versions 1  trained tokens 3 (exact 0, proxy 3)  spans [[2, 5]]" in lines
    assert "version 3" not in out


def test_limit_keeps_the_latest_and_a_skipped_step_says_so(tmp_path):
    code, out = samples(str(run_dir(tmp_path)), "--limit", "1")
    assert code == 0 and out.count("trained at version") == 1
    assert "step 4  trained at version 3  a1 (group a)  reward 0  advantage -1  finish stop  (step skipped)" in out


def test_trained_tokens_are_styled_by_exact_and_proxy(tmp_path):
    rec = read_samples(run_dir(tmp_path))[0]
    console = Console(force_terminal=True, color_system="standard", width=200)
    with console.capture() as cap:
        console.print(sample_text(rec))
    ansi = cap.get()
    assert "\x1b[1;32mw12 w13 \x1b[0m" in ansi  # trained, exact: bold green
    assert "\x1b[2mw14 \x1b[0m" in ansi  # tool output, not trained: dim
    assert "\x1b[1;33mw15 w16 \x1b[0m" in ansi  # trained, proxy: bold yellow


def test_errors_are_one_line(tmp_path):
    code, out = samples(str(tmp_path / "nowhere"))
    assert code == 2 and out.strip() == f"samples error: RUN_DIR: '{tmp_path / 'nowhere'}' has no samples.jsonl"
    code, out = samples(str(run_dir(tmp_path)), "--version", "7")
    assert code == 1 and out.strip() == f"no samples trained at version 7 in {tmp_path} (versions there: [2, 3])"
