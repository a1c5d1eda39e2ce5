"""The GPU check's pure parts: Adam's step bound, log-prob tolerances, the weight-change rule, the
wheel list and sizes, and the borrowed machine's package closure."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from deploy.gpu_bounds import BF16_REL, FP32_TOL, adam_step_bound, logprob_tolerance, weight_change_excess
from deploy.gpu_rehearse import canonical, closure
from deploy.gpu_wheels import CARRIED, Carried, check_limit, download_command, missing_modules, size_report


def test_adam_step_bound_by_hand():
    # step 1: m_hat = g, v_hat = g^2, so |m_hat| / sqrt(v_hat) = 1 exactly
    assert adam_step_bound(1) == 1.0
    # step 2 (b1 0.9, b2 0.999): c = (0.09, 0.1) / 0.19, d = (0.000999, 0.001) / 0.001999
    c = (0.09 / 0.19, 0.1 / 0.19)
    d = (0.000999 / 0.001999, 0.001 / 0.001999)
    assert adam_step_bound(2) == pytest.approx(math.sqrt(c[0] ** 2 / d[0] + c[1] ** 2 / d[1]), rel=1e-12)
    assert adam_step_bound(2) == pytest.approx(1.001358, abs=1e-6)  # 0.448978 + 0.553740 = 1.002718
    # no momentum and no history (b1 = b2 = 0): the update is g / |g|, at every step
    assert adam_step_bound(3, beta1=0.0, beta2=0.0) == 1.0
    # momentum without a second-moment history: the step is not bounded
    assert adam_step_bound(2, beta1=0.9, beta2=0.0) == math.inf
    with pytest.raises(ValueError, match="t: Adam steps count from 1, got 0"):
        adam_step_bound(0)


def test_logprob_tolerance_by_hand():
    assert logprob_tolerance("float32", 7.0) == FP32_TOL == 1e-5
    # bf16: 4 * 2^-8 * |logit|max + fp32 slack; |logit| 2 -> 0.03125 + 1e-5
    assert BF16_REL == 1 / 256
    assert logprob_tolerance("bfloat16", 2.0) == pytest.approx(0.03125 + 1e-5, abs=1e-15)
    assert logprob_tolerance("bfloat16", -2.0) == logprob_tolerance("bfloat16", 2.0)
    with pytest.raises(ValueError, match="dtype: 'float16' is not float32 or bfloat16"):
        logprob_tolerance("float16", 1.0)
    with pytest.raises(ValueError, match="max_abs_logit: must be finite, got nan"):
        logprob_tolerance("bfloat16", math.nan)


def test_weight_change_excess_by_hand():
    before = {"w": torch.tensor([1.0, 0.5]), "b": torch.tensor([0.0])}
    after = {"w": torch.tensor([1.003, 0.5]), "b": torch.tensor([0.0])}
    # element 0: |1.003 - 1.0| - 0.001 * 1.003 = 0.001997; element 1: 0 - 0.0005; b: 0 - 0
    assert weight_change_excess(before, after, 0.001) == pytest.approx(0.001997, abs=1e-7)
    assert weight_change_excess(before, before, 0.0) == 0.0


def test_size_report_and_limit(tmp_path):
    (tmp_path / "b.whl").write_bytes(b"\0" * (2**19))
    (tmp_path / "a.whl").write_bytes(b"\0" * (2**20))
    lines, total = size_report(sorted(tmp_path.iterdir()))
    assert total == 1_572_864
    assert [x.split() for x in lines] == [
        ["a.whl", "1.00", "MiB"],
        ["b.whl", "0.50", "MiB"],
        ["total", "(2", "files)", "1.50", "MiB"],
    ]
    check_limit(60 * 2**20, 60.0)  # at the limit: fine
    with pytest.raises(ValueError, match=r"carried total: 60.50 MiB is over --limit-mib 60"):
        check_limit(int(60.5 * 2**20), 60.0)


def test_download_commands(tmp_path):
    core = Carried("pydantic-core", "binary", "x")
    cmd = download_command(core, "2.50.5", tmp_path, "3.12")
    assert cmd[:3] == [sys.executable, "-m", "pip"] and "pydantic-core==2.50.5" in cmd
    joined = " ".join(cmd)
    assert "--only-binary :all: --python-version 3.12 --implementation cp" in joined
    assert "--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64" in joined
    assert "--no-deps" in cmd and cmd[cmd.index("-d") + 1] == str(tmp_path)
    sdist = download_command(Carried("deepspeed", "sdist", "x"), "0.19.8", tmp_path, "3.12")
    assert sdist[-2:] == ["--no-binary", ":all:"] and "--python-version" not in sdist
    pure = download_command(Carried("hjson", "pure", "x"), "3.1.0", tmp_path, "3.12")
    assert pure[-2:] == ["--only-binary", ":all:"] and "--platform" not in pure
    with pytest.raises(ValueError, match="python_version: '312' is not MAJOR.MINOR"):
        download_command(core, "2.50.5", tmp_path, "312")


def test_carried_names_and_missing_modules():
    names = {p.name: p for p in CARRIED}
    assert names["py-cpuinfo"].import_name == "cpuinfo" and names["pydantic-core"].import_name == "pydantic_core"
    assert {p.kind for p in CARRIED if p.name in ("pydantic-core", "msgpack", "xxhash")} == {"binary"}
    assert names["deepspeed"].kind == "sdist"
    probe = (Carried("json", "pure", "stdlib"), Carried("no-such-vintage-probe", "pure", "absent"))
    assert missing_modules(probe) == ["no_such_vintage_probe"]


def test_borrowed_closure_leaves_carried_out():
    assert canonical("Typing_Extensions") == "typing-extensions"
    got = {canonical(d.metadata["Name"]) for d in closure(("pydantic",), leave_out={"typing_extensions"})}
    assert got == {"pydantic", "pydantic-core", "annotated-types", "typing-inspection"}
    assert closure(("no-such-vintage-probe",)) == []


def test_install_wheels_unpacks_records_and_keeps(tmp_path, monkeypatch):
    import zipfile

    import deploy.gpu_wheels as gw

    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "vintage_probe-1.0-py3-none-any.whl", "w") as z:
        z.writestr("vintage_probe/__init__.py", "VALUE = 7\n")
    real = gw.util.find_spec
    monkeypatch.setattr(gw.util, "find_spec", lambda name: None if name == "pip" else real(name))  # no pip
    assert gw.install_wheels(wheels, target) == "unzip"
    assert (target / "vintage_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    size = (wheels / "vintage_probe-1.0-py3-none-any.whl").stat().st_size
    assert (target / ".vintage-wheels").read_text() == f"vintage_probe-1.0-py3-none-any.whl {size}\n"
    assert gw.install_wheels(wheels, target) == "kept"  # the same wheels: nothing is rewritten
    with pytest.raises(FileNotFoundError, match="--wheels: no \\*.whl in .*empty; run `make gpu-wheels`"):
        gw.install_wheels(tmp_path / "empty", target)
