"""Seeded, in-memory shop data: customers, products and their orders.

Everything is a pure function of the seed (one `random.Random(seed)`, never the global RNG), so
a task built on `generate_shop(seed)` can recompute its ground truth at any time. IDs are sampled
from realistic ranges rather than numbered 1..n, so an agent has to look them up, not guess them.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any

FIRST_NAMES: tuple[str, ...] = (
    "Maria", "Jonas", "Aisha", "Lukas", "Sofia", "Mateo", "Hannah", "Noah", "Chloe", "Elias",
    "Priya", "Oscar", "Lena", "Tomas", "Yuki", "Amara", "Felix", "Ingrid", "Diego", "Nora",
    "Rafael", "Clara", "Omar", "Freya", "Marco", "Leila", "Henrik", "Zoe", "Samuel", "Mei",
    "Anton", "Isabel", "Kofi", "Julia", "Victor", "Emma", "Arjun", "Lucia", "Pavel", "Grace",
)  # fmt: skip
LAST_NAMES: tuple[str, ...] = (
    "Keller", "Novak", "Okafor", "Lindqvist", "Rossi", "Tanaka", "Moreau", "Schmidt", "Garcia",
    "Jansen", "Kowalski", "Haddad", "Fischer", "Silva", "Nakamura", "Petrov", "Dubois", "Berg",
    "Costa", "Meyer", "Andersen", "Romero", "Weber", "Brennan", "Hoffmann", "Mensah", "Larsen",
    "Vargas", "Walsh", "Kim", "Ibrahim", "Richter", "Popescu", "Horvat", "Duarte", "Sato",
    "Byrne", "Laine", "Marsh", "Quinn",
)  # fmt: skip
CITIES: tuple[str, ...] = (
    "Berlin", "Lisbon", "Lyon", "Oslo", "Porto", "Vienna", "Zurich", "Dublin", "Krakow",
    "Madrid", "Utrecht", "Gothenburg", "Turin", "Leeds", "Ghent", "Tallinn",
)  # fmt: skip
EMAIL_DOMAINS: tuple[str, ...] = ("example.com", "mail.example.org", "inbox.example.net")
TIERS: tuple[str, ...] = ("standard", "silver", "gold", "platinum")
TIER_WEIGHTS: tuple[float, ...] = (0.55, 0.25, 0.15, 0.05)
ORDER_STATUSES: tuple[str, ...] = ("paid", "shipped", "delivered", "refunded", "cancelled")
STATUS_WEIGHTS: tuple[float, ...] = (0.25, 0.2, 0.4, 0.1, 0.05)
CATALOGUE: tuple[tuple[str, str], ...] = (
    ("Trail Running Shoes", "footwear"), ("Leather Ankle Boots", "footwear"),
    ("Canvas Sneakers", "footwear"), ("Wool Hiking Socks", "apparel"),
    ("Merino Base Layer", "apparel"), ("Rain Shell Jacket", "apparel"),
    ("Linen Shirt", "apparel"), ("Down Vest", "apparel"), ("Cotton Hoodie", "apparel"),
    ("Insulated Water Bottle", "outdoor"), ("Two-Person Tent", "outdoor"),
    ("Trekking Poles", "outdoor"), ("Headlamp 300lm", "outdoor"), ("Camping Stove", "outdoor"),
    ("Daypack 24L", "bags"), ("Messenger Bag", "bags"), ("Travel Duffel 40L", "bags"),
    ("Laptop Sleeve 14in", "bags"), ("Wireless Earbuds", "electronics"),
    ("USB-C Charger 65W", "electronics"), ("Bluetooth Speaker", "electronics"),
    ("E-Reader", "electronics"), ("Smart Watch Strap", "electronics"),
    ("Power Bank 20000mAh", "electronics"), ("Pour-Over Coffee Set", "kitchen"),
    ("Cast Iron Skillet", "kitchen"), ("Chef's Knife", "kitchen"),
    ("Bamboo Cutting Board", "kitchen"),
    ("Espresso Cups (4)", "kitchen"), ("Yoga Mat", "fitness"), ("Resistance Bands", "fitness"),
    ("Adjustable Dumbbell", "fitness"), ("Jump Rope", "fitness"), ("Desk Lamp", "home"),
    ("Linen Duvet Cover", "home"), ("Scented Candle", "home"), ("Wall Clock", "home"),
    ("Notebook A5 Dotted", "stationery"), ("Fountain Pen", "stationery"),
    ("Weekly Planner", "stationery"),
)  # fmt: skip

_CUSTOMER_IDS = range(1000, 10000)
_PRODUCT_IDS = range(100, 1000)
_ORDER_IDS = range(100_000, 1_000_000)
_FIRST_DAY = dt.date(2021, 1, 1).toordinal()
_LAST_DAY = dt.date(2024, 12, 31).toordinal()


@dataclass(frozen=True)
class Customer:
    """A shop customer; `email` is derived from the (unique) name."""

    id: int
    name: str
    email: str
    city: str
    tier: str
    signup_date: str

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "email": self.email,
            "city": self.city,
            "tier": self.tier,
            "signup_date": self.signup_date,
        }


@dataclass(frozen=True)
class Product:
    """A catalogue product with its current price."""

    id: int
    name: str
    category: str
    price: float

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "category": self.category, "price": self.price}


@dataclass(frozen=True)
class OrderItem:
    """One line of an order, at the price paid."""

    product_id: int
    quantity: int
    unit_price: float

    def as_json(self) -> dict[str, Any]:
        return {
            "product_id": self.product_id,
            "quantity": self.quantity,
            "unit_price": self.unit_price,
        }


@dataclass(frozen=True)
class Order:
    """An order; `total` is `sum(quantity * unit_price)` rounded to cents."""

    id: int
    customer_id: int
    date: str
    status: str
    items: tuple[OrderItem, ...]
    total: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "customer_id": self.customer_id,
            "date": self.date,
            "status": self.status,
            "items": [item.as_json() for item in self.items],
            "total": self.total,
        }


@dataclass(frozen=True)
class ShopData:
    """One shop's records, each tuple sorted by id (order ids grow with the date), with lookups."""

    seed: int
    customers: tuple[Customer, ...]
    products: tuple[Product, ...]
    orders: tuple[Order, ...]

    def customer(self, customer_id: int) -> Customer | None:
        return self._customers_by_id.get(customer_id)

    def customers_named(self, query: str) -> tuple[Customer, ...]:
        """Customers whose name contains `query`, case-insensitively, sorted by id."""
        needle = query.casefold()
        return tuple(c for c in self.customers if needle in c.name.casefold())

    def orders_of(self, customer_id: int) -> tuple[Order, ...]:
        """A customer's orders sorted by date, then id (empty for an unknown customer)."""
        return self._orders_by_customer.get(customer_id, ())

    def order(self, order_id: int) -> Order | None:
        return self._orders_by_id.get(order_id)

    def product(self, product_id: int) -> Product | None:
        return self._products_by_id.get(product_id)

    @cached_property
    def _customers_by_id(self) -> dict[int, Customer]:
        return {c.id: c for c in self.customers}

    @cached_property
    def _products_by_id(self) -> dict[int, Product]:
        return {p.id: p for p in self.products}

    @cached_property
    def _orders_by_id(self) -> dict[int, Order]:
        return {o.id: o for o in self.orders}

    @cached_property
    def _orders_by_customer(self) -> dict[int, tuple[Order, ...]]:
        grouped: dict[int, list[Order]] = {}
        for order in self.orders:
            grouped.setdefault(order.customer_id, []).append(order)
        return {cid: tuple(sorted(os, key=lambda o: (o.date, o.id))) for cid, os in grouped.items()}


def generate_shop(
    seed: int, *, n_customers: int = 12, n_products: int = 15, max_orders: int = 14
) -> ShopData:
    """Build a shop deterministically from `seed`.

    At least one customer has no orders and (with two or more customers) one has exactly
    `max_orders`, so both the empty case and multi-page pagination always occur. The last few
    shops built are kept (the records are frozen): an episode's task and its service ask for the
    same shop, ~0.9 ms each.
    """
    _check_sizes(n_customers, n_products, max_orders)
    return _built_shop(seed, n_customers, n_products, max_orders)


@lru_cache(maxsize=64)
def _built_shop(seed: int, n_customers: int, n_products: int, max_orders: int) -> ShopData:
    rng = random.Random(seed)
    customers = _customers(rng, n_customers)
    products = _products(rng, n_products)
    counts = _order_counts(rng, n_customers, max_orders)
    drafts = [
        _order(rng, customer, products)
        for customer, count in zip(customers, counts)
        for _ in range(count)
    ]
    drafts.sort(key=lambda o: (o.date, o.customer_id))
    # Order ids grow with the order date, as a real shop's would.
    order_ids = sorted(rng.sample(_ORDER_IDS, len(drafts)))
    orders = [replace(draft, id=oid) for draft, oid in zip(drafts, order_ids)]
    return ShopData(
        seed=seed,
        customers=tuple(sorted(customers, key=lambda c: c.id)),
        products=tuple(sorted(products, key=lambda p: p.id)),
        orders=tuple(orders),
    )


def _check_sizes(n_customers: int, n_products: int, max_orders: int) -> None:
    max_customers = len(FIRST_NAMES) * len(LAST_NAMES)
    if not 1 <= n_customers <= max_customers:
        raise ValueError(f"n_customers must be in [1, {max_customers}], got {n_customers}")
    if not 1 <= n_products <= len(CATALOGUE):
        raise ValueError(f"n_products must be in [1, {len(CATALOGUE)}], got {n_products}")
    if max_orders < 0:
        raise ValueError(f"max_orders must be >= 0, got {max_orders}")


def _customers(rng: random.Random, n: int) -> list[Customer]:
    ids = rng.sample(_CUSTOMER_IDS, n)
    name_codes = rng.sample(range(len(FIRST_NAMES) * len(LAST_NAMES)), n)
    customers = []
    for cid, code in zip(ids, name_codes):
        first, last = FIRST_NAMES[code // len(LAST_NAMES)], LAST_NAMES[code % len(LAST_NAMES)]
        customers.append(
            Customer(
                id=cid,
                name=f"{first} {last}",
                email=f"{first.lower()}.{last.lower()}@{rng.choice(EMAIL_DOMAINS)}",
                city=rng.choice(CITIES),
                tier=rng.choices(TIERS, TIER_WEIGHTS)[0],
                signup_date=_iso(rng.randint(_FIRST_DAY, _LAST_DAY - 365)),
            )
        )
    return customers


def _products(rng: random.Random, n: int) -> list[Product]:
    ids = rng.sample(_PRODUCT_IDS, n)
    entries = rng.sample(CATALOGUE, n)
    prices = [round(rng.randint(3, 240) + rng.choice((0.0, 0.49, 0.99)), 2) for _ in range(n)]
    return [
        Product(id=pid, name=name, category=category, price=price)
        for pid, (name, category), price in zip(ids, entries, prices)
    ]


def _order_counts(rng: random.Random, n_customers: int, max_orders: int) -> list[int]:
    """Orders per customer: mostly a few, one customer with none, one with `max_orders`."""
    typical = (0, 1, 1, 2, 2, 3, 4, 5, 6, 8)
    counts = [min(max_orders, rng.choice(typical)) for _ in range(n_customers)]
    slots = rng.sample(range(n_customers), min(2, n_customers))
    counts[slots[0]] = 0
    if len(slots) > 1:
        counts[slots[1]] = max_orders
    return counts


def _order(rng: random.Random, customer: Customer, products: list[Product]) -> Order:
    """A draft order (id 0) placed on or after the customer's signup."""
    first_day = dt.date.fromisoformat(customer.signup_date).toordinal()
    picked = rng.sample(products, rng.randint(1, min(4, len(products))))
    quantities = rng.choices((1, 2, 3), (0.7, 0.2, 0.1), k=len(picked))
    items = tuple(OrderItem(p.id, q, p.price) for p, q in zip(picked, quantities))
    return Order(
        id=0,
        customer_id=customer.id,
        date=_iso(rng.randint(first_day, _LAST_DAY)),
        status=rng.choices(ORDER_STATUSES, STATUS_WEIGHTS)[0],
        items=items,
        total=round(sum(i.quantity * i.unit_price for i in items), 2),
    )


def _iso(ordinal: int) -> str:
    return dt.date.fromordinal(ordinal).isoformat()
