from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpcore
import httpx
import pytest
import respx
from cgym.mock_apis.shop import (
    BASE_URL,
    MAX_PER_PAGE,
    ShopData,
    ShopService,
    generate_shop,
    mocked,
)

from cgym import mock_apis

SEEDS = [0, 1, 7, 12345]


@pytest.fixture
def data() -> ShopData:
    return generate_shop(3)


@pytest.fixture
def client(data: ShopData) -> Iterator[httpx.Client]:
    with ShopService(data).client() as client:
        yield client


def busiest(data: ShopData) -> int:
    return max(data.customers, key=lambda c: len(data.orders_of(c.id))).id


def idle(data: ShopData) -> int:
    return next(c.id for c in data.customers if not data.orders_of(c.id))


# -- data ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{s}" for s in SEEDS])
def test_shop_is_deterministic_per_seed(seed: int) -> None:
    assert generate_shop(seed) == generate_shop(seed)


@pytest.mark.parametrize("a, b", [(0, 1), (1, 2), (7, 12345)], ids=["0-1", "1-2", "7-12345"])
def test_different_seeds_give_different_shops(a: int, b: int) -> None:
    one, other = generate_shop(a), generate_shop(b)
    assert one.customers != other.customers
    assert one.orders != other.orders


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{s}" for s in SEEDS])
def test_shop_records_are_realistic_and_consistent(seed: int) -> None:
    shop = generate_shop(seed)
    names = [c.name for c in shop.customers]
    assert len(shop.customers) == 12 and len(shop.products) == 15
    assert len(set(names)) == len(names)
    assert len({c.email for c in shop.customers}) == len(names)
    assert all(1000 <= c.id <= 9999 for c in shop.customers)
    assert all(o.id > 99_999 for o in shop.orders)
    assert [c.id for c in shop.customers] != list(range(1, 13))
    for order in shop.orders:
        customer = shop.customer(order.customer_id)
        assert customer is not None and order.date >= customer.signup_date
        assert order.total == round(sum(i.quantity * i.unit_price for i in order.items), 2)
        assert all(shop.product(i.product_id) is not None for i in order.items)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{s}" for s in SEEDS])
def test_some_customers_have_no_orders_and_one_needs_three_pages(seed: int) -> None:
    counts = [len(generate_shop(seed).orders_of(c.id)) for c in generate_shop(seed).customers]
    assert 0 in counts
    assert max(counts) == 14


def test_orders_of_is_sorted_by_date_then_id(data: ShopData) -> None:
    for customer in data.customers:
        orders = data.orders_of(customer.id)
        assert list(orders) == sorted(orders, key=lambda o: (o.date, o.id))
        assert all(o.customer_id == customer.id for o in orders)
    assert sum(len(data.orders_of(c.id)) for c in data.customers) == len(data.orders)


def test_lookups_find_records_and_miss_unknown_ids(data: ShopData) -> None:
    customer, order, product = data.customers[0], data.orders[0], data.products[0]
    assert data.customer(customer.id) == customer
    assert data.order(order.id) == order
    assert data.product(product.id) == product
    assert data.customer(1) is None and data.order(1) is None and data.product(1) is None
    assert data.orders_of(1) == ()


def test_customers_named_is_a_case_insensitive_substring_match(data: ShopData) -> None:
    customer = data.customers[0]
    last = customer.name.split()[1]
    found = data.customers_named(last.upper()[1:])
    assert customer in found
    assert all(last[1:].lower() in c.name.lower() for c in found)
    assert data.customers_named("no such person") == ()


@pytest.mark.parametrize(
    "kwargs",
    [{"n_customers": 0}, {"n_products": 0}, {"n_products": 1000}, {"max_orders": -1}],
    ids=["no-customers", "no-products", "too-many-products", "negative-orders"],
)
def test_bad_sizes_are_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="got"):
        generate_shop(0, **kwargs)


def test_generating_a_shop_takes_well_under_5_ms() -> None:
    best = min(_elapsed(lambda: generate_shop(42)) for _ in range(20))
    assert best < 0.005


def test_building_a_service_takes_under_1_ms(data: ShopData) -> None:
    best = min(_elapsed(lambda: ShopService(data)) for _ in range(50))
    assert best < 0.001


def _elapsed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


# -- endpoints -----------------------------------------------------------------------------------


def test_search_customers_by_name(client: httpx.Client, data: ShopData) -> None:
    customer = data.customers[0]
    response = client.get("/customers", params={"name": customer.name.lower()})
    assert response.status_code == 200
    assert response.json() == {"customers": [customer.as_json()]}


def test_get_customer(client: httpx.Client, data: ShopData) -> None:
    customer = data.customers[-1]
    assert client.get(f"/customers/{customer.id}").json() == customer.as_json()


def test_get_order_includes_items(client: httpx.Client, data: ShopData) -> None:
    order = data.orders[3]
    body = client.get(f"/orders/{order.id}").json()
    assert body == order.as_json()
    assert body["items"][0].keys() == {"product_id", "quantity", "unit_price"}


def test_get_product(client: httpx.Client, data: ShopData) -> None:
    product = data.products[2]
    assert client.get(f"/products/{product.id}").json() == product.as_json()


@pytest.mark.parametrize(
    "method, path, params, status, error",
    [
        ("GET", "/customers", {}, 400, "missing_parameter"),
        ("GET", "/customers", {"name": "  "}, 400, "missing_parameter"),
        ("GET", "/customers/1", {}, 404, "not_found"),
        ("GET", "/customers/abc", {}, 400, "invalid_id"),
        ("GET", "/customers/1/orders", {}, 404, "not_found"),
        ("GET", "/orders/1", {}, 404, "not_found"),
        ("GET", "/orders/-3", {}, 400, "invalid_id"),
        ("GET", "/products/1", {}, 404, "not_found"),
        ("GET", "/products", {"page": "0"}, 400, "invalid_parameter"),
        ("GET", "/invoices", {}, 404, "not_found"),
        ("DELETE", "/products/1", {}, 405, "method_not_allowed"),
    ],
    ids=[
        "search-without-name",
        "search-blank-name",
        "unknown-customer",
        "non-numeric-customer-id",
        "orders-of-unknown-customer",
        "unknown-order",
        "negative-order-id",
        "unknown-product",
        "products-page-zero",
        "unknown-endpoint",
        "wrong-method",
    ],
)
def test_errors_are_json_with_a_code(
    client: httpx.Client, method: str, path: str, params: dict[str, str], status: int, error: str
) -> None:
    response = client.request(method, path, params=params)
    assert response.status_code == status
    assert response.json()["error"] == error
    assert response.json()["message"]


# -- pagination ----------------------------------------------------------------------------------


def fetch_all(client: httpx.Client, path: str, key: str, **params: int) -> list[dict]:
    items, page = [], 1
    while True:
        body = client.get(path, params={"page": page, **params}).json()
        items += body[key]
        if page >= body["total_pages"]:
            return items
        page += 1


@pytest.mark.parametrize("per_page", [1, 2, 5], ids=["per-page-1", "per-page-2", "per-page-5"])
def test_pagination_covers_every_order_exactly_once(
    client: httpx.Client, data: ShopData, per_page: int
) -> None:
    for customer in data.customers:
        path = f"/customers/{customer.id}/orders"
        orders = fetch_all(client, path, "orders", per_page=per_page)
        assert orders == [o.as_json() for o in data.orders_of(customer.id)]


def test_busiest_customer_needs_three_pages(client: httpx.Client, data: ShopData) -> None:
    body = client.get(f"/customers/{busiest(data)}/orders").json()
    assert (body["page"], body["per_page"], body["total"], body["total_pages"]) == (1, 5, 14, 3)
    assert len(body["orders"]) == 5


def test_products_pagination_covers_the_catalogue(client: httpx.Client, data: ShopData) -> None:
    assert fetch_all(client, "/products", "products") == [p.as_json() for p in data.products]


def test_per_page_above_the_maximum_is_clamped_and_says_so(
    client: httpx.Client, data: ShopData
) -> None:
    body = client.get(f"/customers/{busiest(data)}/orders", params={"per_page": 50}).json()
    assert body["per_page"] == body["max_per_page"] == MAX_PER_PAGE
    assert len(body["orders"]) == MAX_PER_PAGE
    assert "clamped" in body["notice"]


def test_page_past_the_end_is_empty_with_metadata(client: httpx.Client, data: ShopData) -> None:
    response = client.get(f"/customers/{busiest(data)}/orders", params={"page": 4})
    assert response.status_code == 200
    assert response.json() == {
        "orders": [],
        "page": 4,
        "per_page": 5,
        "max_per_page": 5,
        "total": 14,
        "total_pages": 3,
    }


def test_customer_without_orders_has_an_empty_first_page(
    client: httpx.Client, data: ShopData
) -> None:
    body = client.get(f"/customers/{idle(data)}/orders").json()
    assert (body["orders"], body["total"], body["total_pages"]) == ([], 0, 0)


@pytest.mark.parametrize(
    "params",
    [{"page": "0"}, {"page": "-1"}, {"page": "two"}, {"page": "1.5"}, {"per_page": "0"}],
    ids=["page-zero", "page-negative", "page-word", "page-float", "per-page-zero"],
)
def test_bad_page_values_are_400(
    client: httpx.Client, data: ShopData, params: dict[str, str]
) -> None:
    response = client.get(f"/customers/{busiest(data)}/orders", params=params)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_parameter"


# -- auth ----------------------------------------------------------------------------------------


@pytest.fixture
def secured(data: ShopData) -> ShopService:
    return ShopService(data, require_auth=True)


def login(client: httpx.Client, service: ShopService) -> str:
    username, password = service.credentials
    response = client.post("/auth/token", json={"username": username, "password": password})
    assert response.status_code == 200
    body = response.json()
    assert body["token_type"] == "bearer" and body["expires_in"] == 3600
    return body["access_token"]


def test_token_is_stable_per_seed_and_differs_across_seeds() -> None:
    tokens = []
    for seed in (1, 1, 2):
        service = ShopService(generate_shop(seed), require_auth=True)
        with service.client() as client:
            tokens.append(login(client, service))
    assert tokens[0] == tokens[1] != tokens[2]


@pytest.mark.parametrize(
    "path",
    ["/customers?name=a", "/customers/1", "/customers/1/orders", "/orders/1", "/products",
     "/products/1"],
    ids=["search", "customer", "orders", "order", "products", "product"],
)  # fmt: skip
def test_every_endpoint_needs_a_token(secured: ShopService, path: str) -> None:
    with secured.client() as client:
        response = client.get(path)
        assert response.status_code == 401
        assert response.json()["error"] == "unauthorized"
        assert response.headers["WWW-Authenticate"] == "Bearer"
        wrong = client.get(path, headers={"Authorization": "Bearer tok_wrong"})
        assert wrong.status_code == 401


def test_a_valid_token_opens_every_endpoint(secured: ShopService, data: ShopData) -> None:
    with secured.client() as client:
        token = login(client, secured)
        customer = data.customers[0]
        for scheme in ("Bearer", "bearer"):
            headers = {"Authorization": f"{scheme} {token}"}
            response = client.get(f"/customers/{customer.id}", headers=headers)
            assert response.json() == customer.as_json()


@pytest.mark.parametrize(
    "body, status, error",
    [
        ({"username": "shop-agent", "password": "guess"}, 401, "invalid_credentials"),
        ({"username": "someone", "password": "pw"}, 401, "invalid_credentials"),
        ({"username": "shop-agent"}, 400, "invalid_request"),
        ({}, 400, "invalid_request"),
        ([1, 2], 400, "invalid_request"),
        ("not json", 400, "invalid_request"),
    ],
    ids=["wrong-password", "wrong-user", "no-password", "empty", "array", "not-json"],
)
def test_bad_logins_are_rejected(
    secured: ShopService, body: object, status: int, error: str
) -> None:
    with secured.client() as client:
        if isinstance(body, str):
            response = client.post("/auth/token", content=body)
        else:
            response = client.post("/auth/token", json=body)
    assert response.status_code == status
    assert response.json()["error"] == error


def test_custom_credentials(data: ShopData) -> None:
    service = ShopService(data, require_auth=True, credentials=("ana", "s3cret"))
    with service.client() as client:
        ok = client.post("/auth/token", json={"username": "ana", "password": "s3cret"})
    assert ok.status_code == 200


# -- request log ---------------------------------------------------------------------------------


def test_request_log_shows_which_pages_were_fetched(data: ShopData) -> None:
    service = ShopService(data)
    cid = busiest(data)
    with service.client() as client:
        client.get(f"/customers/{cid}/orders", params={"page": 1})
        client.get(f"/customers/{cid}/orders", params={"page": 3})
        client.get("/orders/1")
    assert service.requests == [
        ("GET", f"/customers/{cid}/orders", {"page": "1"}, 200, None),
        ("GET", f"/customers/{cid}/orders", {"page": "3"}, 200, None),
        ("GET", "/orders/1", {}, 404, None),
    ]
    fetched = {r.params.get("page") for r in service.requests if r.path.endswith("/orders")}
    assert "2" not in fetched


# -- the two ways in -----------------------------------------------------------------------------


def test_mocked_serves_module_level_httpx() -> None:
    with mock_apis.shop.mocked(seed=1) as api:
        customer = api.data.customers[0]
        last_name = customer.name.split()[1]
        response = httpx.get(f"{api.base_url}/customers", params={"name": last_name})
        assert customer.as_json() in response.json()["customers"]
        with httpx.Client(base_url=api.base_url) as client:
            assert client.get(f"/customers/{customer.id}").json() == customer.as_json()
    assert api.base_url == BASE_URL
    assert [r.status for r in api.requests] == [200, 200]


def test_mocked_with_auth_and_faults() -> None:
    with mocked(seed=2, faults=1.0, require_auth=True) as api:
        username, password = api.credentials
        body = {"username": username, "password": password}
        first = _safe_post(f"{api.base_url}/auth/token", body)
        assert first is None or first.status_code != 200  # the first request always faults
        token = httpx.post(f"{api.base_url}/auth/token", json=body).json()["access_token"]
        assert token == ShopService(api.data, require_auth=True).token
    assert api.requests[0].fault is not None and api.requests[1].fault is None


def _safe_post(url: str, body: dict[str, str]) -> httpx.Response | None:
    try:
        return httpx.post(url, json=body)
    except httpx.ReadTimeout:
        return None


def test_mocked_rejects_other_hosts() -> None:
    with mocked(seed=0), pytest.raises(respx.models.AllMockedAssertionError):
        httpx.get("https://elsewhere.example.test/")


def test_mocked_accepts_prebuilt_data(data: ShopData) -> None:
    with mocked(data=data) as api:
        assert api.data is data
        order = data.orders[0]
        assert httpx.get(f"{api.base_url}/orders/{order.id}").json() == order.as_json()


def test_client_works_without_patching_httpx(data: ShopData) -> None:
    original = httpcore.ConnectionPool.handle_request

    def unpatched(request: httpx.Request) -> None:
        assert httpcore.ConnectionPool.handle_request is original

    service = ShopService(data)
    with service.client(event_hooks={"request": [unpatched]}) as client:
        assert client.get(f"{BASE_URL}/products/{data.products[0].id}").status_code == 200
    assert httpcore.ConnectionPool.handle_request is original


def test_clients_of_different_services_run_side_by_side_in_threads() -> None:
    seeds = list(range(8))
    results: dict[int, list[dict]] = {}

    def episode(seed: int) -> None:
        data = generate_shop(seed)
        with ShopService(data).client() as client:
            results[seed] = [client.get(f"/customers/{c.id}").json() for c in data.customers]

    threads = [threading.Thread(target=episode, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed in seeds:
        assert results[seed] == [c.as_json() for c in generate_shop(seed).customers]


def test_mock_apis_imports_neither_torch_nor_envs() -> None:
    code = "import sys, mock_apis; print(sorted(m for m in sys.modules if m in ('torch', 'envs')))"
    root = Path(mock_apis.__file__).parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.timing
def test_latency_delays_every_request_faulted_or_not(data: ShopData) -> None:
    service = ShopService(data, faults=mock_apis.FaultPlan(1.0, seed=0), latency_s=0.02)
    with service.client() as client:
        start = time.perf_counter()
        for _ in range(4):  # at rate 1, faults and successes alternate
            try:
                client.get(f"/customers/{data.customers[0].id}")
            except httpx.ReadTimeout:
                pass
        elapsed = time.perf_counter() - start
    assert [r.fault is None for r in service.requests] == [False, True, False, True]
    assert 4 * 0.02 <= elapsed < 4 * 0.02 + 0.5


@pytest.mark.timing
def test_latency_waits_overlap_across_threads(data: ShopData) -> None:
    """The wait sleeps with the GIL released, as a real network round trip does."""
    def fetch() -> None:
        with ShopService(data, latency_s=0.1).client() as client:
            client.get("/products")

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.perf_counter() - start < 0.5  # not 8 * 0.1


@pytest.mark.parametrize("latency_s", [-0.1, float("nan")], ids=["negative", "nan"])
def test_bad_latency_is_rejected(data: ShopData, latency_s: float) -> None:
    with pytest.raises(ValueError, match="latency_s"):
        ShopService(data, latency_s=latency_s)


def test_a_shop_asked_for_again_is_the_same_frozen_records() -> None:
    """An episode's task and its service ask for one shop: built once, the same records as a
    fresh build (the cache's function run directly)."""
    from cgym.mock_apis.shop import data

    first = generate_shop(424242)
    assert generate_shop(424242) is first
    assert data._built_shop.__wrapped__(424242, 12, 15, 14) == first
    assert generate_shop(424242, n_customers=5) != first
