"""Report tasks drawn from a seeded shop: what to look up, which fields, the true values.

Difficulty sets the work: *easy* copies a customer's fields (one call); *medium* chains a
customer search into their orders and aggregates them (one page); *hard* needs a token first,
paginates through more orders than fit on a page, resolves a product and survives faults.
Train and test tasks come from disjoint shops (even vs odd shop seeds).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from cgym.mock_apis.shop.data import Customer, ShopData, generate_shop
from cgym.mock_apis.shop.service import MAX_PER_PAGE, default_credentials

Difficulty = Literal["easy", "medium", "hard"]
Split = Literal["train", "test"]
COUNTED_STATUSES = frozenset({"paid", "shipped", "delivered"})

FIELD_TYPES: dict[str, str] = {
    "customer_id": "integer",
    "email": "string",
    "city": "string",
    "tier": "string",
    "signup_date": "string",
    "order_count": "integer",
    "total_spent": "number",
    "top_product": "string",
}
_EASY_FIELDS = (("customer_id", "email", "city"), ("customer_id", "tier", "signup_date"))
_MEDIUM_FIELDS = ("customer_id", "order_count", "total_spent")
_HARD_FIELDS = ("customer_id", "order_count", "total_spent", "top_product")


@dataclass(frozen=True)
class ReportTask:
    """One task: the shop it runs on, the customer, the required fields and their values.

    Everything the prompt states is here as data, for agents that read `info["task"]`: the
    customer's name, the report's `fields` (with `field_types`), and the `credentials` to pass
    to get_token when `require_auth`.
    """

    id: str
    difficulty: Difficulty
    shop_seed: int
    customer: Customer
    fields: tuple[str, ...]  # the JSON fields the report must contain, in the prompt's order
    expected: dict[str, Any]  # their true values
    require_auth: bool  # the API needs a token from get_token(*credentials)
    credentials: tuple[str, str]  # (username, password) of the shop's API
    prompt: str

    @property
    def customer_name(self) -> str:
        """The name the prompt asks about (search_customers finds the customer by it)."""
        return self.customer.name

    @property
    def field_types(self) -> dict[str, str]:
        """The JSON type of each required field, as the prompt states it."""
        return {name: FIELD_TYPES[name] for name in self.fields}

    @property
    def ground_truth(self) -> str:
        return json.dumps(self.expected)

    @property
    def order_pages(self) -> int:
        return max(1, -(-int(self.expected.get("order_count", 0)) // MAX_PER_PAGE))


def sample_task(rng: np.random.Generator, difficulty: Difficulty, split: Split) -> ReportTask:
    """Draw a task; the same generator state always gives the same task."""
    while True:
        shop_seed = 2 * int(rng.integers(0, 2**30)) + (split == "test")
        shop = generate_shop(shop_seed)
        candidates = [c for c in shop.customers if _fits(shop, c, difficulty)]
        if candidates:
            break
    customer = candidates[int(rng.integers(len(candidates)))]
    fields = _EASY_FIELDS[int(rng.integers(2))] if difficulty == "easy" else (_MEDIUM_FIELDS if difficulty == "medium" else _HARD_FIELDS)
    expected = {name: _value(shop, customer, name) for name in fields}
    require_auth = difficulty == "hard"
    credentials = default_credentials(shop_seed)
    prompt = _prompt(customer, fields, credentials if require_auth else None)
    task_id = f"api-{difficulty}-{shop_seed}-{customer.id}"
    return ReportTask(task_id, difficulty, shop_seed, customer, fields, expected, require_auth, credentials, prompt)


def _fits(shop: ShopData, customer: Customer, difficulty: Difficulty) -> bool:
    n_orders = len(shop.orders_of(customer.id))
    if difficulty == "medium":
        return 1 <= n_orders <= MAX_PER_PAGE
    if difficulty == "hard":
        return n_orders > MAX_PER_PAGE
    return True


def _value(shop: ShopData, customer: Customer, name: str) -> Any:
    orders = shop.orders_of(customer.id)
    if name == "customer_id":
        return customer.id
    if name == "order_count":
        return len(orders)
    if name == "total_spent":
        return round(sum(o.total for o in orders if o.status in COUNTED_STATUSES), 2)
    if name == "top_product":
        return top_product(shop, orders)
    return getattr(customer, name)


def top_product(shop: ShopData, orders: Any) -> str:
    """The product with the most units over the counted orders; ties go to the lower id."""
    units: Counter[int] = Counter()
    for order in orders:
        if order.status in COUNTED_STATUSES:
            for item in order.items:
                units[item.product_id] += item.quantity
    if not units:
        return ""
    best = min(units, key=lambda pid: (-units[pid], pid))
    product = shop.product(best)
    return product.name if product else ""


def _prompt(customer: Customer, fields: tuple[str, ...], credentials: tuple[str, str] | None) -> str:
    wanted = ", ".join(f"{name} ({FIELD_TYPES[name]})" for name in fields)
    lines = [f'Task: write a report on the customer named "{customer.name}".', f"Required JSON fields: {wanted}."]
    if "total_spent" in fields:
        lines.append("Rules: order_count counts all orders; total_spent sums the totals of paid, shipped and delivered orders only.")
    if "top_product" in fields:
        lines.append("top_product is the name of the product with the most units in those counted orders (ties: lowest product id).")
    if credentials:
        lines.append(f'Auth: call get_token with username "{credentials[0]}" and password "{credentials[1]}", then pass the token to every other call.')
    lines.append("Reply with the JSON object (a one-line summary before it is allowed).")
    return "\n".join(lines)
