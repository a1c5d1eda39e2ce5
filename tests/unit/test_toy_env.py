"""The toy alphabet task: hand-worked rewards, determinism, the env contract."""

from __future__ import annotations

import pytest

from rollout.envs import check_reset, check_step, load_env
from rollout.envs.toy import AlphabetEnv, alphabet_fraction


def test_hand_worked_fractions():
    # "bad" : b, a, d all in a-m -> 3/3
    assert alphabet_fraction("bad") == 1.0
    # "hello": h e l l in a-m, o not -> 4/5
    assert alphabet_fraction("hello") == pytest.approx(0.8)
    # " cat!": space, c, a, t, ! -> c a in a-m -> 2/5
    assert alphabet_fraction(" cat!") == pytest.approx(0.4)
    # "XYZ 42": nothing in a-m -> 0
    assert alphabet_fraction("XYZ 42") == 0.0
    # uppercase does not count: "Bad" -> a d -> 2/3
    assert alphabet_fraction("Bad") == pytest.approx(2 / 3)
    assert alphabet_fraction("") == 0.0
    # another alphabet: vowels in "banana" -> a a a -> 3/6
    assert alphabet_fraction("banana", "aeiou") == pytest.approx(0.5)


def test_step_rewards_and_optimum():
    env = AlphabetEnv()
    msgs, info = env.reset(7)
    assert msgs[-1]["role"] == "user" and "abcdefghijklm" in msgs[-1]["content"]
    assert info["alphabet"] == "abcdefghijklm"
    obs, r, done, info = env.step("michael")  # m i c h a e l -> 7/7
    assert (obs, r, done) == ([], 1.0, True) and info["optimum"] == 1.0
    assert env.step("made in zoo")[1] == pytest.approx(5 / 11)  # m a d e _ i n _ z o o: m a d e i
    assert env.step("")[1] == 0.0
    # strip: surrounding whitespace not scored; " bad " -> 3/5 unstripped, 1.0 stripped
    assert env.step(" bad ")[1] == pytest.approx(0.6)


def test_made_in_zoo_count():
    # m, a, d, e, ' ', i, n, ' ', z, o, o: in a-m are m a d e i -> 5 of 11 ('n' is past 'm')
    text = "made in zoo"
    assert len(text) == 11
    assert sum(c in "abcdefghijklm" for c in text) == 5
    assert alphabet_fraction(text) == pytest.approx(5 / 11)


def test_strip_option():
    env = AlphabetEnv(strip=True)
    env.reset(0)
    assert env.step(" bad ")[1] == 1.0


def test_prompt_is_procedural_and_deterministic():
    env = AlphabetEnv(prompt_words=3)
    a, b = env.reset(1)[0], env.reset(2)[0]
    assert env.reset(1)[0] == a
    assert any(env.reset(s)[0] != a for s in range(2, 10)) or a != b
    assert AlphabetEnv(prompt_words=0).prompt(5) == AlphabetEnv(prompt_words=0).prompt(6)


def test_contract_and_errors():
    env = load_env("rollout.envs.toy:AlphabetEnv", alphabet="xyz")
    check_reset(env.reset(3), "toy")
    _, r, done, _ = check_step(env.step("xyzzy"), "toy")
    assert r == 1.0 and done
    with pytest.raises(ValueError, match="alphabet"):
        AlphabetEnv(alphabet="")
    with pytest.raises(ValueError, match="prompt_words"):
        AlphabetEnv(prompt_words=-1)
    with pytest.raises(RuntimeError, match="before reset"):
        AlphabetEnv().step("a")
