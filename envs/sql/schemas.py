"""Seeded SQLite databases for the SQL env: a shop, an HR department and an airline network.

Each schema is a generator `fn(rng) -> {table: (rows, pk, foreign_keys)}` written with
`sqlite-utils`. Databases are small (hundreds of rows, built in tens of milliseconds) but need
joins, aggregates and NULL handling to query. `database_path(schema, seed)` builds a file once
per (schema, seed) into a shared cache directory, atomically (temp file + rename), and reuses it.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Literal

import sqlite_utils
from cgym.envs.errors import check_choice

SchemaName = Literal["shop", "hr", "flights"]
SCHEMAS: tuple[SchemaName, ...] = ("shop", "hr", "flights")
DEFAULT_SEED = 7
# Cached files are keyed by this module's source, so editing a generator never reuses a stale file.
_SOURCE_KEY = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:10]

TableSpec = tuple[list[dict[str, Any]], str, list[tuple[str, str, str]]]

FIRST = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Xena", "Yusuf", "Zoe")
LAST = ("Adams", "Brown", "Chen", "Diaz", "Evans", "Fischer", "Garcia", "Hansen", "Ito", "Jones", "Khan", "Lopez",
        "Meyer", "Novak", "Okafor", "Park", "Quint", "Rossi", "Silva", "Tanaka", "Ueda", "Varga", "Weber", "Young")
CITIES = (("Berlin", "Germany"), ("Munich", "Germany"), ("Paris", "France"), ("Lyon", "France"), ("Madrid", "Spain"),
          ("Lisbon", "Portugal"), ("Rome", "Italy"), ("Milan", "Italy"), ("Vienna", "Austria"), ("Oslo", "Norway"),
          ("Dublin", "Ireland"), ("Warsaw", "Poland"))
CATEGORIES = {
    "books": ("Atlas", "Cookbook", "Novel", "Poetry Set", "Field Guide"),
    "garden": ("Hose", "Rake", "Planter", "Seed Kit", "Shears"),
    "kitchen": ("Kettle", "Skillet", "Knife Block", "Blender", "Teapot"),
    "electronics": ("Headphones", "Charger", "Speaker", "Keyboard", "Webcam"),
    "toys": ("Puzzle", "Kite", "Robot Kit", "Yo-yo", "Board Game"),
    "sports": ("Yoga Mat", "Dumbbells", "Jump Rope", "Helmet", "Water Bottle"),
}
ADJECTIVES = ("Classic", "Deluxe", "Eco", "Mini", "Pro", "Smart")
DEPARTMENTS = (("Engineering", "Berlin"), ("Sales", "Paris"), ("Marketing", "Paris"), ("Finance", "Vienna"),
               ("Support", "Lisbon"), ("Research", "Oslo"), ("Legal", "Vienna"), ("Operations", "Madrid"))
TITLES = ("Analyst", "Engineer", "Manager", "Specialist", "Associate", "Director")
PROJECT_WORDS = ("Apollo", "Beacon", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor", "Indigo", "Juniper",
                 "Keystone", "Lumen", "Meridian", "Nimbus", "Orion", "Pioneer", "Quartz", "Radius")
AIRPORTS = (("BER", "Berlin Brandenburg", "Berlin", "Germany"), ("MUC", "Munich", "Munich", "Germany"),
            ("FRA", "Frankfurt", "Frankfurt", "Germany"), ("CDG", "Charles de Gaulle", "Paris", "France"),
            ("ORY", "Orly", "Paris", "France"), ("MAD", "Barajas", "Madrid", "Spain"), ("BCN", "El Prat", "Barcelona", "Spain"),
            ("LIS", "Humberto Delgado", "Lisbon", "Portugal"), ("FCO", "Fiumicino", "Rome", "Italy"),
            ("MXP", "Malpensa", "Milan", "Italy"), ("VIE", "Vienna", "Vienna", "Austria"), ("OSL", "Gardermoen", "Oslo", "Norway"),
            ("DUB", "Dublin", "Dublin", "Ireland"), ("WAW", "Chopin", "Warsaw", "Poland"), ("AMS", "Schiphol", "Amsterdam", "Netherlands"),
            ("ZRH", "Zurich", "Zurich", "Switzerland"))
AIRLINES = (("Aurora Air", "LH", "Germany"), ("Bluewing", "BW", "France"), ("Corsa", "CS", "Italy"), ("Delmar", "DM", "Spain"),
            ("Fjord Jet", "FJ", "Norway"), ("Liffey", "LF", "Ireland"))
NATIONALITIES = ("German", "French", "Spanish", "Italian", "Irish", "Polish", "Norwegian", "Dutch")


def _person(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        if name not in taken:
            taken.add(name)
            return name


def _day(rng: random.Random, start: date, span_days: int) -> str:
    return (start + timedelta(days=rng.randrange(span_days))).isoformat()


def shop(rng: random.Random) -> dict[str, TableSpec]:
    """Customers, products, orders and order items (line totals = quantity * unit_price)."""
    names: set[str] = set()
    customers = []
    for cid in range(1, 61):
        name = _person(rng, names)
        city, country = rng.choice(CITIES)
        customers.append({
            "id": cid, "name": name, "email": f"{name.lower().replace(' ', '.')}@example.com", "city": city,
            "country": country, "signup_date": _day(rng, date(2021, 1, 1), 900),
            "tier": rng.choice(("basic", "basic", "silver", "gold")),
            "phone": None if rng.random() < 0.3 else f"+{rng.randrange(10**9, 10**10)}",
        })
    products = []
    pid = 0
    for category, items in CATEGORIES.items():
        for item in items:
            pid += 1
            products.append({
                "id": pid, "name": f"{rng.choice(ADJECTIVES)} {item}", "category": category,
                "price": round(rng.uniform(3, 250), 2), "stock": rng.choice((0, rng.randrange(1, 120))),
            })
    orders, items_rows = [], []
    for oid in range(1, 241):
        status = rng.choice(("paid", "shipped", "shipped", "delivered", "delivered", "pending", "cancelled"))
        ordered = _day(rng, date(2023, 1, 1), 540)
        shipped = None if status in ("pending", "cancelled") else (date.fromisoformat(ordered) + timedelta(days=rng.randrange(1, 9))).isoformat()
        orders.append({"id": oid, "customer_id": rng.randrange(1, 58), "order_date": ordered, "status": status,
                       "shipped_date": shipped, "coupon": rng.choice((None, None, None, "WELCOME10", "SPRING5"))})
        for product in rng.sample(products, rng.randrange(1, 5)):
            items_rows.append({"id": len(items_rows) + 1, "order_id": oid, "product_id": product["id"], "quantity": rng.randrange(1, 5),
                               "unit_price": product["price"]})
    return {
        "customers": (customers, "id", []),
        "products": (products, "id", []),
        "orders": (orders, "id", [("customer_id", "customers", "id")]),
        "order_items": (items_rows, "id", [("order_id", "orders", "id"), ("product_id", "products", "id")]),
    }


def hr(rng: random.Random) -> dict[str, TableSpec]:
    """Departments, employees (with managers and some unassigned staff), projects, assignments."""
    departments = [{"id": i, "name": name, "location": loc, "budget": rng.randrange(200, 2000) * 1000}
                   for i, (name, loc) in enumerate(DEPARTMENTS, 1)]
    names: set[str] = set()
    employees = []
    for eid in range(1, 121):
        first, last = _person(rng, names).split(" ")
        dept = None if eid > 8 and rng.random() < 0.07 else (eid if eid <= 8 else rng.randrange(1, 8))
        employees.append({
            "id": eid, "first_name": first, "last_name": last, "email": f"{first[0].lower()}{last.lower()}{eid}@corp.example",
            "department_id": dept, "manager_id": None if eid <= 8 else rng.randrange(1, 9) if dept is None else dept,
            "title": "Director" if eid <= 8 else rng.choice(TITLES[:-1]), "hire_date": _day(rng, date(2012, 1, 1), 4200),
            "salary": rng.randrange(38, 160) * 1000, "bonus": None if rng.random() < 0.4 else rng.randrange(1, 20) * 500,
        })
    projects = []
    for pid, word in enumerate(PROJECT_WORDS, 1):
        start = _day(rng, date(2022, 1, 1), 700)
        end = None if rng.random() < 0.35 else (date.fromisoformat(start) + timedelta(days=rng.randrange(60, 400))).isoformat()
        projects.append({"id": pid, "name": f"Project {word}", "department_id": rng.randrange(1, 8), "start_date": start,
                         "end_date": end, "budget": rng.randrange(20, 500) * 1000})
    assignments, seen = [], set()
    while len(assignments) < 260:
        emp, proj = rng.randrange(1, 121), rng.randrange(1, len(PROJECT_WORDS) - 1)
        if (emp, proj) in seen:
            continue
        seen.add((emp, proj))
        assignments.append({"id": len(assignments) + 1, "employee_id": emp, "project_id": proj,
                            "role": rng.choice(("lead", "member", "member", "reviewer")), "hours": rng.randrange(4, 400)})
    return {
        "departments": (departments, "id", []),
        "employees": (employees, "id", [("department_id", "departments", "id"), ("manager_id", "employees", "id")]),
        "projects": (projects, "id", [("department_id", "departments", "id")]),
        "assignments": (assignments, "id", [("employee_id", "employees", "id"), ("project_id", "projects", "id")]),
    }


def flights(rng: random.Random) -> dict[str, TableSpec]:
    """Airports, airlines, scheduled flights (some delayed or cancelled), passengers, bookings."""
    airports = [{"code": c, "name": n, "city": city, "country": country} for c, n, city, country in AIRPORTS]
    airlines = [{"id": i, "name": n, "iata": code, "country": country} for i, (n, code, country) in enumerate(AIRLINES, 1)]
    codes = [a["code"] for a in airports]
    flight_rows = []
    for fid in range(1, 221):
        origin, destination = rng.sample(codes[:-1], 2)
        airline = rng.randrange(1, len(AIRLINES))  # the last airline has no flights (LEFT JOIN questions)
        status = rng.choice(("on_time", "on_time", "on_time", "delayed", "delayed", "cancelled"))
        flight_rows.append({
            "id": fid, "flight_no": f"{AIRLINES[airline - 1][1]}{100 + fid}", "airline_id": airline, "origin": origin,
            "destination": destination, "departure": f"{_day(rng, date(2024, 3, 1), 120)} {rng.randrange(5, 23):02d}:{rng.choice((0, 15, 30, 45)):02d}",
            "duration_min": rng.randrange(55, 260), "status": status,
            "delay_min": rng.randrange(5, 240) if status == "delayed" else None, "base_fare": round(rng.uniform(29, 420), 2),
        })
    names: set[str] = set()
    passengers = [{"id": i, "name": _person(rng, names), "nationality": rng.choice(NATIONALITIES),
                   "birth_year": rng.randrange(1950, 2008), "frequent_flyer": rng.choice((None, None, "silver", "gold"))}
                  for i in range(1, 101)]
    bookings, seen = [], set()
    while len(bookings) < 420:
        flight, passenger = rng.randrange(1, 221), rng.randrange(1, 98)
        if (flight, passenger) in seen:
            continue
        seen.add((flight, passenger))
        seat_class = rng.choice(("economy", "economy", "economy", "business", "first"))
        factor = {"economy": 1.0, "business": 2.5, "first": 4.0}[seat_class]
        bookings.append({"id": len(bookings) + 1, "flight_id": flight, "passenger_id": passenger, "seat_class": seat_class,
                         "price": round(flight_rows[flight - 1]["base_fare"] * factor, 2),
                         "seat": None if rng.random() < 0.2 else f"{rng.randrange(1, 40)}{rng.choice('ABCDEF')}"})
    return {
        "airports": (airports, "code", []),
        "airlines": (airlines, "id", []),
        "flights": (flight_rows, "id", [("airline_id", "airlines", "id"), ("origin", "airports", "code"), ("destination", "airports", "code")]),
        "passengers": (passengers, "id", []),
        "bookings": (bookings, "id", [("flight_id", "flights", "id"), ("passenger_id", "passengers", "id")]),
    }


GENERATORS: dict[SchemaName, Callable[[random.Random], dict[str, TableSpec]]] = {"shop": shop, "hr": hr, "flights": flights}


def build(schema: SchemaName, seed: int, path: str | os.PathLike[str]) -> Path:
    """Write the seeded `schema` database to `path` (which must not exist yet)."""
    check_choice("schema", schema, SCHEMAS)
    tables = GENERATORS[schema](random.Random(f"{schema}:{seed}"))
    db = sqlite_utils.Database(path)
    try:
        for name, (rows, pk, fks) in tables.items():
            db[name].insert_all(rows, pk=pk, foreign_keys=fks or None, column_order=list(rows[0]))
    finally:
        db.close()
    return Path(path)


def cache_dir() -> Path:
    """Where built databases live: `$CGYM_SQL_CACHE` or `<tmp>/cgym-sql`."""
    root = os.environ.get("CGYM_SQL_CACHE") or os.path.join(tempfile.gettempdir(), "cgym-sql")
    return Path(root)


def database_path(schema: SchemaName, seed: int = DEFAULT_SEED) -> Path:
    """The cached database file for (schema, seed), built on first use; safe across processes."""
    check_choice("schema", schema, SCHEMAS)
    target = cache_dir() / f"{schema}-{seed}-{_SOURCE_KEY}.sqlite"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{schema}-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    os.unlink(tmp)  # sqlite-utils wants to create the file itself
    try:
        build(schema, seed, tmp)
        os.replace(tmp, target)  # atomic: readers never see a half-written database
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes (tests use it to prove the sandbox never writes)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
