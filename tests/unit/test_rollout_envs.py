"""Environment contract, built-in environments and the chat-template token bookkeeping."""

from __future__ import annotations

import pytest

from rollout.envs import check_reset, check_step, import_attr, load_env
from rollout.envs.reasoning_gym_env import ReasoningGymEnv, extract_answer
from rollout.envs.retail import RetailEnv, parse_call

BUILTINS = [
    "rollout.envs.reasoning_gym_env:ReasoningGymEnv",
    "rollout.envs.retail:RetailEnv",
    "rollout.envs.scripted:ScriptedEnv",
]


@pytest.mark.parametrize("path", BUILTINS)
def test_builtin_envs_satisfy_the_contract(path):
    env = load_env(path)
    msgs, info = check_reset(env.reset(3), path)
    assert msgs and isinstance(info, dict)
    obs, reward, done, info = check_step(env.step("nothing useful"), path)
    assert isinstance(reward, float) and isinstance(done, bool)
    assert done or obs  # an episode that goes on must say something back
    assert getattr(env, "max_turns", 1) >= 1


def test_import_path_errors_name_the_path():
    with pytest.raises(ValueError, match="not of the form"):
        import_attr("rollout.envs.retail.RetailEnv")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        import_attr("no_such_pkg.mod:X")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        import_attr("rollout.envs.retail:Nope")
    with pytest.raises(TypeError, match="no callable reset"):
        load_env("rollout.envs.retail:TOOLS")


def test_check_step_rejects_malformed_results():
    with pytest.raises(TypeError, match="must return"):
        check_step(([], 1.0, True), "e")
    with pytest.raises(TypeError, match="not finite"):
        check_step(([], float("nan"), True, {}), "e")
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        check_step(([{"role": "tool"}], 0.0, False, {}), "e")


def test_reasoning_gym_reward_from_its_scorer():
    env = ReasoningGymEnv("basic_arithmetic", level="easy")
    msgs, info = env.reset(5)
    assert "Calculate" in msgs[-1]["content"] and msgs[0]["role"] == "system"
    assert env.step(f"Let me think. Answer: {info['answer']}")[1] == 1.0
    assert env.step(f"so it is {info['answer']}")[1] == 1.0  # bare last number is scored
    assert env.step("I do not know")[1] == 0.0
    assert env.reset(5)[1] == info  # deterministic
    with pytest.raises(ValueError, match="level"):
        ReasoningGymEnv("basic_arithmetic", level="impossible")


def test_extract_answer():
    assert extract_answer("x\nAnswer: 14.\nmore") == "14"
    assert extract_answer("3 plus 4 is 7") == "7"
    assert extract_answer("no digits") == ""


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_retail_solvable_by_the_right_calls(level):
    env = RetailEnv(level)
    _, info = env.reset(11)
    obs, r, done, _ = env.step(f"list_orders({env.customer})")
    assert not done and r == 0.0 and info["target"] in obs[0]["content"]
    tool = "cancel_order" if info["action"] == "cancel" else "return_order"
    obs, r, done, step_info = env.step(f'Sure. {tool}("{info["target"]}")')
    assert done and r == 1.0 and step_info["solved"]


def test_retail_wrong_irreversible_action_ends_with_zero():
    env = RetailEnv("easy")
    env.reset(2)
    other = next(k for k, o in env.db.items() if k != env.target and o["status"] == "pending")
    _, r, done, info = env.step(f"cancel_order({other})")
    assert done and r == 0.0 and info["why"] == "goal unreachable"


def test_retail_no_call_gets_user_reminder_and_max_turns():
    env = RetailEnv("easy", max_turns=2)
    env.reset(0)
    obs, r, done, _ = env.step("Hello! How can I help?")
    assert obs[0]["role"] == "user" and "tool" in obs[0]["content"] and not done
    obs, r, done, info = env.step("still chatting")
    assert done and r == 0.0 and info["why"] == "max_turns"


def test_retail_deterministic_and_parse():
    a, b = RetailEnv("medium"), RetailEnv("medium")
    assert a.reset(7) == b.reset(7) and a.db == b.db
    assert parse_call("do cancel_order( '#W1234' ) now") == ("cancel_order", "W1234")
    assert parse_call("nothing") is None
    with pytest.raises(ValueError, match="level"):
        RetailEnv("expert")


def test_template_chat_format_token_in_token_out(real_model_path):
    from transformers import AutoTokenizer

    from rollout.agent import TemplateChatFormat

    tok = AutoTokenizer.from_pretrained(real_model_path)
    chat = TemplateChatFormat(tok)
    im_end, nl = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode("\n")
    assert chat.close_ids([5, 6, im_end], "stop") == nl  # the model sampled <|im_end|>: add the newline only
    assert chat.close_ids([5, 6], "length") == [im_end] + nl  # cut turn: the worker closes it itself
    obs = chat.observation_ids([{"role": "tool", "content": "done"}])
    assert tok.decode(obs) == "<|im_start|>tool\ndone<|im_end|>\n<|im_start|>assistant\n"
    # prompt + sampled turn + close + observation == the template's render of the whole conversation
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    turn = tok.encode("hello there") + [im_end]
    ids = chat.prompt_ids(msgs) + turn + chat.close_ids(turn, "stop") + obs
    full = msgs + [{"role": "assistant", "content": "hello there"}, {"role": "tool", "content": "done"}]
    assert ids == tok.encode(
        tok.apply_chat_template(full, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
