"""`cgym/ApiReport-v0`: call a mocked shop API, parse the results, write a JSON report."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import httpx
import numpy as np
from cgym.envs.api_report.calls import ApiCall
from cgym.envs.api_report.checks import default_rubric
from cgym.envs.api_report.tasks import Difficulty, ReportTask, Split, sample_task
from cgym.envs.core import AgentEnv
from cgym.envs.errors import check_choice
from cgym.envs.rubric import Rubric
from cgym.envs.tools import Tool
from cgym.mock_apis.faults import FaultPlan
from cgym.mock_apis.shop.data import generate_shop
from cgym.mock_apis.shop.service import ShopService

DEFAULT_MAX_TURNS: dict[str, int] = {"easy": 4, "medium": 6, "hard": 16}
DEFAULT_FAULTS: dict[str, float] = {"easy": 0.0, "medium": 0.0, "hard": 0.1}
_ERROR_CODES: dict[int, str] = {400: "bad_request", 401: "unauthorized", 404: "not_found", 429: "rate_limited"}

SYSTEM_PROMPT = (
    "You are a data analyst with access to a shop's HTTP API through tools. "
    "Call the tools to look up what the task needs, then reply with the JSON report."
)


class ApiReportEnv(AgentEnv):
    """Look up a shop customer through the API and report fields that must match its data.

    Args:
        difficulty: "easy" (copy fields), "medium" (chain + aggregate), "hard" (auth,
            pagination, products, faults).
        split: "train" or "test"; their shops are disjoint.
        max_turns: turn limit (default by difficulty: 4 / 6 / 16).
        faults: share of API requests that fail transiently (default 0, or 0.1 on hard).
        latency_s: seconds every API request waits, as a real HTTP API's round trip would
            (default 0: instant); `run_episodes(..., workers=N)` overlaps these waits.
        rubric: replace the default rubric (same check names recommended).
    """

    system_prompt: ClassVar[str] = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        difficulty: Difficulty = "easy",
        split: Split = "train",
        max_turns: int | None = None,
        faults: float | None = None,
        latency_s: float = 0.0,
        rubric: Rubric | None = None,
        render_mode: str | None = None,
    ) -> None:
        check_choice("difficulty", difficulty, DEFAULT_MAX_TURNS)
        check_choice("split", split, ("train", "test"))
        fault_rate = DEFAULT_FAULTS[difficulty] if faults is None else faults
        if isinstance(fault_rate, bool) or not isinstance(fault_rate, (int, float)) or not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"faults must be a number in [0, 1], got {faults!r}")
        if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not 0.0 <= latency_s <= self.turn_time_s:
            raise ValueError(f"latency_s must be a number of seconds in [0, {self.turn_time_s:g}] (one turn's time budget), got {latency_s!r}")
        self.difficulty: Difficulty = difficulty
        self.split: Split = split
        self.faults = float(fault_rate)
        self.latency_s = float(latency_s)
        self.rubric = rubric or default_rubric()
        self._client: httpx.Client | None = None
        super().__init__(max_turns=DEFAULT_MAX_TURNS[difficulty] if max_turns is None else max_turns, render_mode=render_mode)

    # -- episode setup -------------------------------------------------------------------
    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict[str, Any] | None) -> ReportTask:
        return sample_task(rng, self.difficulty, self.split)

    def begin_episode(self, task: ReportTask) -> None:  # type: ignore[override]
        plan = FaultPlan(self.faults, seed=task.shop_seed) if self.faults > 0 else None
        service = ShopService(generate_shop(task.shop_seed), faults=plan, require_auth=task.require_auth, credentials=task.credentials, latency_s=self.latency_s)
        if self._client is not None:
            self._client.close()
        self._client = service.client(timeout=5.0)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()

    def tools(self) -> list[Tool]:
        methods = (self.get_token, self.search_customers, self.list_orders, self.get_order, self.get_product)
        return [Tool.from_function(m) for m in methods]

    # -- tools ---------------------------------------------------------------------------
    def get_token(self, username: str, password: str) -> str:
        """Exchange API credentials for a bearer token.

        Args:
            username: The API username.
            password: The API password.
        """
        return self._request("get_token", {"username": username, "password": password}, "POST", "/auth/token", body={"username": username, "password": password})

    def search_customers(self, name: str, token: str | None = None) -> str:
        """Find customers whose name contains `name`.

        Args:
            name: Full or partial customer name.
            token: Bearer token from get_token, when the API needs one.
        """
        return self._request("search_customers", {"name": name, "token": token}, "GET", "/customers", params={"name": name})

    def list_orders(self, customer_id: int, page: int = 1, token: str | None = None) -> str:
        """List one page (up to 5) of a customer's orders, oldest first.

        Args:
            customer_id: The customer's id.
            page: 1-based page number; the reply says how many pages there are.
            token: Bearer token from get_token, when the API needs one.
        """
        args = {"customer_id": customer_id, "page": page, "token": token}
        return self._request("list_orders", args, "GET", f"/customers/{customer_id}/orders", params={"page": page})

    def get_order(self, order_id: int, token: str | None = None) -> str:
        """Fetch one order with its items.

        Args:
            order_id: The order's id.
            token: Bearer token from get_token, when the API needs one.
        """
        return self._request("get_order", {"order_id": order_id, "token": token}, "GET", f"/orders/{order_id}")

    def get_product(self, product_id: int, token: str | None = None) -> str:
        """Fetch one product (name, category, price).

        Args:
            product_id: The product's id.
            token: Bearer token from get_token, when the API needs one.
        """
        return self._request("get_product", {"product_id": product_id, "token": token}, "GET", f"/products/{product_id}")

    # -- HTTP ----------------------------------------------------------------------------
    def _request(self, tool: str, arguments: dict[str, Any], method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None) -> str:
        assert self._client is not None, "reset() first"
        step = len(self.episode.steps) + 1 if self.episode else 1
        token = arguments.pop("token", None)
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            response = self._client.request(method, path, params=params, json=body, headers=headers)
        except httpx.TimeoutException:
            return self._log(ApiCall(step, tool, arguments, None, "timeout"), {"error": "timeout", "message": "The request timed out."})
        try:
            data = response.json()
        except ValueError:
            snippet = response.text[:60]
            return self._log(ApiCall(step, tool, arguments, response.status_code, "malformed_json"), {"status": response.status_code, "error": "malformed_json", "body": snippet})
        if response.status_code >= 400:
            code = _ERROR_CODES.get(response.status_code, "server_error" if response.status_code >= 500 else "client_error")
            reply: dict[str, Any] = {"status": response.status_code, "error": code, "message": data.get("message", "") if isinstance(data, dict) else ""}
            if "Retry-After" in response.headers:
                reply["retry_after"] = response.headers["Retry-After"]
            return self._log(ApiCall(step, tool, arguments, response.status_code, code), reply)
        return self._log(ApiCall(step, tool, arguments, response.status_code, None, data), {"status": response.status_code, "data": data})

    @property
    def calls(self) -> list[ApiCall]:
        """This episode's HTTP calls, in order."""
        return self.episode.extras.setdefault("calls", []) if self.episode else []

    def _log(self, call: ApiCall, reply: dict[str, Any]) -> str:
        self.calls.append(call)
        # The separators of the report the model writes (and of envs/tools.py): `"city": "Ghent"`
        # then tokenizes alike in the result and in the answer, so the key leads to the value.
        return json.dumps(reply, separators=(", ", ": "))
