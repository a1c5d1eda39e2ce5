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


def test_retail_closing_turn_takes_one_more_reply_after_the_goal():
    """easy, seed 2, closing turn: the right call returns the tool's result and 0 without ending;
    the reply after it ends the episode with 1. A closing reply that cancels another pending order
    ends it with 0. Solved at the last allowed turn (max_turns 1), the episode ends there with 1."""
    env = RetailEnv("easy", closing_turn=True)
    env.reset(2)
    obs, r, done, _ = env.step(f"cancel_order({env.target})")
    assert (obs, r, done) == ([{"role": "tool", "content": f"order {env.target} cancelled"}], 0.0, False)
    obs, r, done, info = env.step("Your order is cancelled.")
    assert (obs, r, done, info["solved"], info["turn"]) == ([], 1.0, True, True, 2)
    env.reset(2)
    other = next(k for k, o in env.db.items() if k != env.target and o["status"] == "pending")
    env.step(f"cancel_order({env.target})")
    _, r, done, info = env.step(f"cancel_order({other})")
    assert (r, done, info["solved"]) == (0.0, True, False)
    last = RetailEnv("easy", max_turns=1, closing_turn=True)
    last.reset(2)
    _, r, done, info = last.step(f"cancel_order({last.target})")
    assert (r, done, info["solved"]) == (1.0, True, True)


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


def test_retail_agent_waits_the_tool_latency_between_turns(monkeypatch):
    """easy, seed 2, closing turn, tool_latency_s 10, a client that first writes the right call and
    then a closing sentence: two model calls, one wait of 10 s between them (none after the last),
    reward 1. A negative latency is refused before any call."""
    import asyncio
    from types import SimpleNamespace

    from rollout.agents import retail

    env = RetailEnv("easy")
    env.reset(2)
    replies = iter([f"cancel_order({env.target})", "Your order is cancelled."])
    calls, waits = [], []

    class Completions:
        async def create(self, **kw):
            calls.append(len(kw["messages"]))
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=next(replies)))])

    async def sleep(s):
        waits.append(s)

    monkeypatch.setattr(retail.asyncio, "sleep", sleep)
    client = SimpleNamespace(chat=SimpleNamespace(completions=Completions()))
    task = {"seed": 2, "env": {"kwargs": {"level": "easy", "closing_turn": True}}, "tool_latency_s": 10}
    out = asyncio.run(retail.run(task, client))
    assert out == {"reward": 1.0, "turns": 2, "solved": True} and waits == [10.0]
    assert calls[1] == calls[0] + 2  # the reply and the tool's result
    with pytest.raises(ValueError, match=r"task.tool_latency_s: must be >= 0, got -1.0"):
        asyncio.run(retail.run({**task, "tool_latency_s": -1}, client))
