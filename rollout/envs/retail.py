"""A small multi-turn tool-use store, in the spirit of tau-bench retail (deterministic, offline).

World: a store database of orders (id, customer, item, status) built from the episode seed. The
assistant acts by writing a tool call anywhere in its reply, one per turn::

    get_order(W1234)      list_orders(alice)      cancel_order(W1234)      return_order(W1234)

Quotes and a leading ``#`` around the argument are accepted. A scripted user holds a goal (a target
database state) and answers replies that contain no tool call by restating its request.

Rules: only ``pending`` orders can be cancelled, only ``delivered`` orders returned. The episode
ends when the database matches the goal (reward 1.0), when a mutation makes it impossible to reach
(reward 0.0), or after ``max_turns`` model turns (reward 0.0). Reward is 1 exactly when the final
database state equals the goal state. With ``closing_turn`` the episode does not end at the goal:
the store returns the tool's result and the assistant replies once more (to tell the customer), as
in a support conversation; that reply's tool call, if any, runs too, and the reward is 1 when the
database still equals the goal after it. Reaching the goal at the last allowed turn ends the
episode there, so ``max_turns`` bounds every episode.

Levels:

* ``easy``: the user names the order id and the action and spells out the call to make; one
  correct call solves it (a 135M model copies it sometimes, so learning has a signal);
* ``medium``: the user gives only their name; the assistant must ``list_orders`` first, then act
  on the one order in the right state;
* ``hard``: as medium, with several orders per customer and a return instead of a cancellation.
"""

from __future__ import annotations

import copy
import json
import random
import re
from typing import Any

TOOLS = ("get_order", "list_orders", "cancel_order", "return_order")
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
ITEMS = ("lamp", "kettle", "backpack", "keyboard", "mug", "jacket", "headphones", "desk")
_CALL = re.compile(r"\b(" + "|".join(TOOLS) + r")\s*\(\s*[\"'#]*\s*([A-Za-z0-9_]+)\s*[\"']*\s*\)")

SYSTEM = (
    "You are a store support agent. Use exactly one tool call per reply, written like cancel_order(W1001).\n"
    "Tools:\n"
    "- get_order(ORDER_ID): show an order\n"
    "- list_orders(CUSTOMER): list a customer's orders\n"
    "- cancel_order(ORDER_ID): cancel a pending order\n"
    "- return_order(ORDER_ID): return a delivered order"
)

LEVELS = ("easy", "medium", "hard")


def parse_call(text: str) -> tuple[str, str] | None:
    """The first tool call ``(tool, argument)`` in ``text``, or None."""
    m = _CALL.search(text)
    return (m.group(1), m.group(2)) if m else None


class RetailEnv:
    """Multi-turn store-support episode (see the module docstring).

    Args:
        level: ``easy`` | ``medium`` | ``hard``.
        max_turns: most model turns before the episode ends unsolved.
        few_shot: open the conversation with one worked example exchange (tool call + result).
        closing_turn: after the goal is reached, one more assistant reply before the episode ends
            (so a solved episode takes at least two model turns when ``max_turns`` allows).

    Raises:
        ValueError: unknown ``level`` or ``max_turns`` < 1.
    """

    def __init__(self, level: str = "easy", max_turns: int = 4, few_shot: bool = True, closing_turn: bool = False):
        if level not in LEVELS:
            raise ValueError(f"level: {level!r} is not one of {LEVELS}")
        if max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        self.level = level
        self.max_turns = max_turns
        self.few_shot = few_shot
        self.closing_turn = closing_turn
        self.closing = False
        self.db: dict[str, dict[str, str]] = {}
        self.goal: dict[str, dict[str, str]] = {}
        self.turn = 0
        self.request_text = ""

    # --- world -------------------------------------------------------------------------------

    def _build(self, seed: int) -> None:
        rng = random.Random(seed)
        names = rng.sample(NAMES, 4)
        per_customer = 3 if self.level == "hard" else 2
        ids = rng.sample(range(1000, 10000), len(names) * per_customer)
        self.db = {}
        k = 0
        for name in names:
            items = rng.sample(ITEMS, per_customer)  # distinct items: "the lamp" names one order
            for j in range(per_customer):
                status = "pending" if j == 0 else "delivered"
                self.db[f"W{ids[k]}"] = {"customer": name, "item": items[j], "status": status}
                k += 1
        self.customer = names[0]
        own = [oid for oid, o in self.db.items() if o["customer"] == self.customer]
        if self.level == "hard":
            self.action, self.target = "return", rng.choice([o for o in own if self.db[o]["status"] == "delivered"])
        else:
            self.action, self.target = "cancel", next(o for o in own if self.db[o]["status"] == "pending")
        self.goal = copy.deepcopy(self.db)
        self.goal[self.target]["status"] = "cancelled" if self.action == "cancel" else "returned"

    def _user_request(self) -> str:
        o = self.db[self.target]
        if self.level == "easy":
            tool = "cancel_order" if self.action == "cancel" else "return_order"
            return f"Hi, I am {self.customer}. Please {self.action} my order {self.target}. Reply with exactly: {tool}({self.target})"
        if self.level == "medium":
            return f"Hi, I am {self.customer}. Please cancel my order that has not shipped yet."
        return f"Hi, I am {self.customer}. I want to return the {o['item']} I received."

    # --- tools -------------------------------------------------------------------------------

    def _tool(self, name: str, arg: str) -> str:
        if name == "list_orders":
            found = {oid: o for oid, o in self.db.items() if o["customer"] == arg.lower()}
            return json.dumps(found) if found else f"error: no customer {arg}"
        oid = arg.upper()
        if oid not in self.db:
            return f"error: no order {arg}"
        o = self.db[oid]
        if name == "get_order":
            return json.dumps({oid: o})
        if name == "cancel_order":
            if o["status"] != "pending":
                return f"error: order {oid} is {o['status']}, only pending orders can be cancelled"
            o["status"] = "cancelled"
            return f"order {oid} cancelled"
        if o["status"] != "delivered":
            return f"error: order {oid} is {o['status']}, only delivered orders can be returned"
        o["status"] = "returned"
        return f"order {oid} returned"

    def _reachable(self) -> bool:
        # cancel/return are irreversible: a changed order that differs from the goal cannot be fixed
        return all(
            o["status"] == self.goal[k]["status"]
            for k, o in self.db.items()
            if o["status"] in ("cancelled", "returned")
        )

    # --- gym-style interface -----------------------------------------------------------------

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self._build(seed)
        self.turn = 0
        self.closing = False
        self.request_text = self._user_request()
        msgs = [{"role": "system", "content": SYSTEM}]
        if self.few_shot:  # one worked exchange (about another store, ids not in the db)
            msgs += [
                {"role": "user", "content": "Hi, I am zoe. Please cancel my order W0042."},
                {"role": "assistant", "content": "cancel_order(W0042)"},
                {"role": "tool", "content": "order W0042 cancelled"},
                {"role": "assistant", "content": "Your order W0042 is cancelled."},
            ]
        msgs.append({"role": "user", "content": self.request_text})
        return msgs, {"level": self.level, "target": self.target, "action": self.action}

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        if not self.db:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        call = parse_call(action)
        info: dict[str, Any] = {"call": call, "turn": self.turn}
        if call is None:
            obs = [{"role": "user", "content": f"Please use a tool. {self.request_text}"}]
        else:
            obs = [{"role": "tool", "content": self._tool(*call)}]
        if self.closing:
            solved = self.db == self.goal
            return [], float(solved), True, {**info, "solved": solved}
        if self.db == self.goal:
            if self.closing_turn and self.turn < self.max_turns:
                self.closing = True
                return obs, 0.0, False, info
            return [], 1.0, True, {**info, "solved": True}
        if not self._reachable():
            return [], 0.0, True, {**info, "solved": False, "why": "goal unreachable"}
        if self.turn >= self.max_turns:
            return [], 0.0, True, {**info, "solved": False, "why": "max_turns"}
        return obs, 0.0, False, info
