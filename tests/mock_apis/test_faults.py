from __future__ import annotations

import json
import math

import httpx
import pytest
from cgym.mock_apis.faults import FAULT_KINDS, Fault, FaultKind, FaultPlan, faulty_response
from cgym.mock_apis.shop import ShopService, generate_shop
from hypothesis import given, settings
from hypothesis import strategies as st

rates = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
seeds = st.integers(min_value=0, max_value=2**32)


def draw(plan: FaultPlan, n: int) -> list[Fault | None]:
    return [plan.next() for _ in range(n)]


@pytest.mark.parametrize(
    "rate", [-0.01, 1.01, math.nan, 2], ids=["negative", "above-one", "nan", "int-two"]
)
def test_rate_out_of_range_is_rejected_naming_the_value(rate: float) -> None:
    with pytest.raises(ValueError, match=f"got {rate!r}"):
        FaultPlan(rate, seed=0)


@pytest.mark.parametrize("kinds", [(), ("rate_limit", "meteor")], ids=["empty", "unknown-kind"])
def test_bad_kinds_are_rejected(kinds: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="fault kinds"):
        FaultPlan(0.5, seed=0, kinds=kinds)  # type: ignore[arg-type]


def test_same_seed_gives_the_same_plan() -> None:
    assert draw(FaultPlan(0.4, seed=11), 300) == draw(FaultPlan(0.4, seed=11), 300)


def test_different_seeds_give_different_plans() -> None:
    assert draw(FaultPlan(0.4, seed=11), 300) != draw(FaultPlan(0.4, seed=12), 300)


@settings(max_examples=200, deadline=None)
@given(rate=rates, seed=seeds)
def test_never_two_faults_in_a_row(rate: float, seed: int) -> None:
    plan = FaultPlan(rate, seed)
    faults = draw(plan, 200)
    assert not any(a is not None and b is not None for a, b in zip(faults, faults[1:]))
    assert plan.log == [f for f in faults if f is not None]
    assert all(f.ordinal == i for i, f in enumerate(faults) if f is not None)


def test_rate_zero_never_faults() -> None:
    plan = FaultPlan(0.0, seed=5)
    assert draw(plan, 2000) == [None] * 2000
    assert plan.log == []


def test_rate_one_alternates_fault_and_success() -> None:
    faults = draw(FaultPlan(1.0, seed=5), 100)
    assert all(f is not None for f in faults[0::2])
    assert all(f is None for f in faults[1::2])


def test_rate_one_draws_every_kind() -> None:
    kinds = {f.kind for f in draw(FaultPlan(1.0, seed=3), 200) if f is not None}
    assert kinds == set(FAULT_KINDS)


@pytest.mark.parametrize("rate", [0.1, 0.5], ids=["rate-0.1", "rate-0.5"])
def test_observed_fault_fraction_is_rate_over_one_plus_rate(rate: float) -> None:
    n = 20_000
    observed = sum(f is not None for f in draw(FaultPlan(rate, seed=9), n)) / n
    assert observed == pytest.approx(rate / (1 + rate), abs=0.015)


def test_kinds_restricts_the_faults_drawn() -> None:
    faults = draw(FaultPlan(1.0, seed=2, kinds=("timeout",)), 50)
    assert {f.kind for f in faults if f is not None} == {"timeout"}


def test_faulty_response_malformed_json_truncates_the_real_body() -> None:
    request = httpx.Request("GET", "https://x.test/")
    real = httpx.Response(200, json={"orders": [1, 2, 3], "page": 1})
    response = faulty_response(Fault("malformed_json", 0), request, lambda: real)
    assert response.status_code == 200
    assert real.content.startswith(response.content) and response.content != real.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.content)


# -- each fault as an httpx client sees it -------------------------------------------------------


def faulty_shop(kind: FaultKind) -> ShopService:
    """A shop whose first request (and every second one) fails with `kind`."""
    return ShopService(generate_shop(0), faults=FaultPlan(1.0, seed=0, kinds=(kind,)))


def test_rate_limit_is_a_429_with_retry_after() -> None:
    with faulty_shop("rate_limit").client() as client:
        response = client.get("/products")
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"] == "rate_limited"


def test_server_error_is_a_500() -> None:
    with faulty_shop("server_error").client() as client:
        response = client.get("/products")
    assert response.status_code == 500
    assert response.json()["error"] == "internal_error"


def test_timeout_raises_read_timeout() -> None:
    with faulty_shop("timeout").client() as client, pytest.raises(httpx.ReadTimeout):
        client.get("/products")


def test_malformed_json_is_a_200_whose_body_does_not_parse() -> None:
    with faulty_shop("malformed_json").client() as client:
        response = client.get("/products")
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.text)


@pytest.mark.parametrize("kind", FAULT_KINDS, ids=list(FAULT_KINDS))
def test_the_request_after_a_fault_succeeds_and_both_are_logged(kind: FaultKind) -> None:
    service = faulty_shop(kind)
    with service.client() as client:
        try:
            client.get("/products", params={"page": 2})
        except httpx.ReadTimeout:
            pass
        retry = client.get("/products", params={"page": 2})
    assert retry.status_code == 200
    assert retry.json()["page"] == 2
    expected_status = {"rate_limit": 429, "server_error": 500, "timeout": None}.get(kind, 200)
    first, second = service.requests
    assert first == ("GET", "/products", {"page": "2"}, expected_status, kind)
    assert second == ("GET", "/products", {"page": "2"}, 200, None)


@settings(max_examples=40, deadline=None)
@given(rate=rates, seed=seeds)
def test_a_client_that_retries_once_always_gets_through(rate: float, seed: int) -> None:
    data = generate_shop(seed)
    service = ShopService(data, faults=FaultPlan(rate, seed))
    with service.client() as client:
        for product in data.products:
            assert get_with_one_retry(client, f"/products/{product.id}") == product.as_json()


def get_with_one_retry(client: httpx.Client, path: str) -> object:
    for _ in range(2):
        try:
            response = client.get(path)
            if response.status_code == 200:
                return json.loads(response.content)
        except (httpx.TimeoutException, json.JSONDecodeError):
            pass
    raise AssertionError(f"{path} failed twice in a row")
