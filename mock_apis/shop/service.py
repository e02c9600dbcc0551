"""The mocked shop HTTP API: one `respx.MockRouter` over a `ShopData`, with auth and faults.

Two ways in:
- `mocked(seed=...)` patches httpx globally (any `httpx.get` / `httpx.Client` hits the mock),
  for trying an agent by hand or in a test;
- `ShopService(...).client()` returns an `httpx.Client` whose transport is the router, with no
  global patching; envs use it, since they run many services side by side.

Endpoints (paths relative to `BASE_URL`; JSON in and out; errors are
`{"error": <code>, "message": <text>}`):

    POST /auth/token                {"username", "password"} -> {"access_token", ...}
    GET  /customers?name=<q>        case-insensitive substring search
    GET  /customers/{id}
    GET  /customers/{id}/orders     ?page=1&per_page=5 (per_page is capped at 5)
    GET  /orders/{id}
    GET  /products                  ?page=1&per_page=5
    GET  /products/{id}

Every request first waits `latency_s` (a real API's round trip), then goes through the fault
plan (auth included), then the auth check. A service is stateful (fault plan, request log)
and meant for one episode on one thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import httpx
import respx
from cgym.mock_apis.faults import FaultKind, FaultPlan, faulty_response
from cgym.mock_apis.shop.data import ShopData, generate_shop

BASE_URL = "https://shop.example.test/api/v1"
MAX_PER_PAGE = 5
TOKEN_PATH = "/auth/token"
_BASE_PATH = httpx.URL(BASE_URL).path

Handler = Callable[..., httpx.Response]
"""An endpoint: `(service, request, **path_params) -> response`; raises `ApiError` for 4xx."""


class JsonRecord(Protocol):
    """A data record that renders itself as the API's JSON object."""

    def as_json(self) -> dict[str, Any]: ...


class RequestRecord(NamedTuple):
    """One request as the service saw it; `path` is relative to `BASE_URL`."""

    method: str
    path: str
    params: dict[str, str]
    status: int | None
    """The status sent back; `None` when a timeout fault meant no response at all."""
    fault: FaultKind | None


class ApiError(Exception):
    """An error response (4xx) raised by a handler and turned into JSON by the service."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def response(self) -> httpx.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        body = {"error": self.code, "message": self.message}
        return httpx.Response(self.status, headers=headers, json=body)


def default_credentials(seed: int) -> tuple[str, str]:
    """The valid (username, password) of a shop built from `seed`."""
    digest = hashlib.blake2b(f"shop-password:{seed}".encode(), digest_size=6).hexdigest()
    return "shop-agent", f"pw-{digest}"


def access_token(seed: int, username: str) -> str:
    """The bearer token the shop hands `username`: stable per seed, not guessable from ids."""
    digest = hashlib.blake2b(f"shop-token:{seed}:{username}".encode(), digest_size=16)
    return f"tok_{digest.hexdigest()}"


class ShopService:
    """The shop API over `data`, served by one `respx.MockRouter` (`self.router`).

    `faults` (optional) decides which requests fail; with `require_auth`, every endpoint but
    `POST /auth/token` needs `Authorization: Bearer <token>`. `latency_s` is slept (the GIL
    released) before every request is served, so clients that wait on several services at once
    behave as they would against a remote API. `requests` logs every request.
    """

    base_url: str = BASE_URL

    def __init__(
        self,
        data: ShopData,
        *,
        faults: FaultPlan | None = None,
        require_auth: bool = False,
        credentials: tuple[str, str] | None = None,
        latency_s: float = 0.0,
    ) -> None:
        if not latency_s >= 0.0:  # also refuses NaN
            raise ValueError(f"latency_s must be a number of seconds >= 0, got {latency_s!r}")
        self.data = data
        self.latency_s = float(latency_s)
        self.faults = faults
        self.require_auth = require_auth
        self.credentials = credentials or default_credentials(data.seed)
        self.token = access_token(data.seed, self.credentials[0])
        self.requests: list[RequestRecord] = []
        self.router = self._build_router()

    def client(self, **kwargs: Any) -> httpx.Client:
        """An `httpx.Client` served by this service's router, without patching httpx globally.

        Relative URLs resolve against `BASE_URL`; `kwargs` go to `httpx.Client`.
        """
        transport = httpx.MockTransport(self.router.handler)
        return httpx.Client(transport=transport, base_url=self.base_url, **kwargs)

    # -- request pipeline ----------------------------------------------------------------------

    def _build_router(self) -> respx.MockRouter:
        # One respx route for the whole API, dispatched by `_ENDPOINTS`: each respx route costs
        # ~70 us to build, and an env builds a service per episode. Other hosts stay unmocked.
        router = respx.MockRouter(
            base_url=BASE_URL, assert_all_called=False, assert_all_mocked=True
        )
        router.route(name="shop").side_effect = self._handle
        return router

    def _handle(self, request: httpx.Request) -> httpx.Response:
        """Serve one request: the latency, the fault plan, then auth and the endpoint; log it."""
        if self.latency_s:
            time.sleep(self.latency_s)
        path = request.url.path[len(_BASE_PATH) :] or "/"

        def serve() -> httpx.Response:
            return self._respond(request, path)

        fault = self.faults.next() if self.faults is not None else None
        if fault is not None:
            self._record(request, path, fault.status, fault.kind)
            return faulty_response(fault, request, serve)
        response = serve()
        self._record(request, path, response.status_code, None)
        return response

    def _respond(self, request: httpx.Request, path: str) -> httpx.Response:
        try:
            self._authorize(request, path)
            handler, path_params = _resolve(request.method, path)
            return handler(self, request, **path_params)
        except ApiError as error:
            return error.response()

    def _authorize(self, request: httpx.Request, path: str) -> None:
        if not self.require_auth or path == TOKEN_PATH:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or token.strip() != self.token:
            message = f"Send 'Authorization: Bearer <token>' with a token from POST {TOKEN_PATH}."
            raise ApiError(401, "unauthorized", message)

    def _record(
        self, request: httpx.Request, path: str, status: int | None, fault: FaultKind | None
    ) -> None:
        params = dict(request.url.params)
        self.requests.append(RequestRecord(request.method, path, params, status, fault))

    # -- handlers ------------------------------------------------------------------------------

    def _issue_token(self, request: httpx.Request) -> httpx.Response:
        body = _json_body(request)
        username, password = body.get("username"), body.get("password")
        if not isinstance(username, str) or not isinstance(password, str):
            message = 'Body must be {"username": "...", "password": "..."}.'
            raise ApiError(400, "invalid_request", message)
        if (username, password) != self.credentials:
            raise ApiError(401, "invalid_credentials", "Unknown username or wrong password.")
        token = {"access_token": self.token, "token_type": "bearer", "expires_in": 3600}
        return httpx.Response(200, json=token)

    def _search_customers(self, request: httpx.Request) -> httpx.Response:
        name = request.url.params.get("name", "").strip()
        if not name:
            raise ApiError(400, "missing_parameter", "Query parameter 'name' is required.")
        found = [c.as_json() for c in self.data.customers_named(name)]
        return httpx.Response(200, json={"customers": found})

    def _get_customer(self, request: httpx.Request, customer_id: str) -> httpx.Response:
        customer = self.data.customer(_parse_id(customer_id, "customer"))
        if customer is None:
            raise _not_found("customer", customer_id)
        return httpx.Response(200, json=customer.as_json())

    def _customer_orders(self, request: httpx.Request, customer_id: str) -> httpx.Response:
        cid = _parse_id(customer_id, "customer")
        if self.data.customer(cid) is None:
            raise _not_found("customer", customer_id)
        page = _page("orders", self.data.orders_of(cid), request.url.params)
        return httpx.Response(200, json=page)

    def _get_order(self, request: httpx.Request, order_id: str) -> httpx.Response:
        order = self.data.order(_parse_id(order_id, "order"))
        if order is None:
            raise _not_found("order", order_id)
        return httpx.Response(200, json=order.as_json())

    def _list_products(self, request: httpx.Request) -> httpx.Response:
        page = _page("products", self.data.products, request.url.params)
        return httpx.Response(200, json=page)

    def _get_product(self, request: httpx.Request, product_id: str) -> httpx.Response:
        product = self.data.product(_parse_id(product_id, "product"))
        if product is None:
            raise _not_found("product", product_id)
        return httpx.Response(200, json=product.as_json())


_ENDPOINTS: tuple[tuple[str, re.Pattern[str], Handler], ...] = (
    ("POST", re.compile(r"/auth/token"), ShopService._issue_token),
    ("GET", re.compile(r"/customers"), ShopService._search_customers),
    ("GET", re.compile(r"/customers/(?P<customer_id>[^/]+)"), ShopService._get_customer),
    (
        "GET",
        re.compile(r"/customers/(?P<customer_id>[^/]+)/orders"),
        ShopService._customer_orders,
    ),
    ("GET", re.compile(r"/orders/(?P<order_id>[^/]+)"), ShopService._get_order),
    ("GET", re.compile(r"/products"), ShopService._list_products),
    ("GET", re.compile(r"/products/(?P<product_id>[^/]+)"), ShopService._get_product),
)


def _resolve(method: str, path: str) -> tuple[Handler, dict[str, str]]:
    """The handler and path parameters for `method path`; 404 or 405 when there is none."""
    path_exists = False
    for endpoint_method, pattern, handler in _ENDPOINTS:
        match = pattern.fullmatch(path)
        if match is None:
            continue
        if endpoint_method == method:
            return handler, match.groupdict()
        path_exists = True
    if path_exists:
        raise ApiError(405, "method_not_allowed", f"{method} is not allowed on {path}.")
    raise ApiError(404, "not_found", f"No endpoint {method} {path}.")


@contextmanager
def mocked(
    seed: int = 0,
    *,
    faults: float = 0.0,
    require_auth: bool = False,
    data: ShopData | None = None,
    latency_s: float = 0.0,
) -> Iterator[ShopService]:
    """Serve a shop built from `seed` (or `data`) to all httpx code inside the block.

    `faults` is the fault rate (0..1) of a `FaultPlan` seeded with `seed`; `latency_s` delays
    every request. Example::

        with mocked(seed=1) as api:
            httpx.get(f"{api.base_url}/customers", params={"name": "Keller"})
    """
    plan = FaultPlan(faults, seed)
    service = ShopService(
        data if data is not None else generate_shop(seed),
        faults=plan,
        require_auth=require_auth,
        latency_s=latency_s,
    )
    with service.router:
        yield service


def _page(key: str, records: Sequence[JsonRecord], params: httpx.QueryParams) -> dict[str, Any]:
    """One page of `records` with its metadata; a page past the end is empty, not an error."""
    page = _int_param(params, "page", default=1)
    requested = _int_param(params, "per_page", default=MAX_PER_PAGE)
    per_page = min(requested, MAX_PER_PAGE)
    start = (page - 1) * per_page
    body: dict[str, Any] = {
        key: [record.as_json() for record in records[start : start + per_page]],
        "page": page,
        "per_page": per_page,
        "max_per_page": MAX_PER_PAGE,
        "total": len(records),
        "total_pages": math.ceil(len(records) / per_page),
    }
    if requested > MAX_PER_PAGE:
        body["notice"] = f"per_page={requested} exceeds the maximum; clamped to {MAX_PER_PAGE}."
    return body


def _int_param(params: httpx.QueryParams, name: str, *, default: int) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    if not _is_digits(raw) or int(raw) < 1:
        message = f"'{name}' must be a positive integer, got {raw!r}."
        raise ApiError(400, "invalid_parameter", message)
    return int(raw)


def _parse_id(raw: str, kind: str) -> int:
    if not _is_digits(raw):
        raise ApiError(400, "invalid_id", f"A {kind} id is a positive integer, got {raw!r}.")
    return int(raw)


def _is_digits(raw: str) -> bool:
    return raw.isascii() and raw.isdigit()


def _not_found(kind: str, raw_id: str) -> ApiError:
    return ApiError(404, "not_found", f"No {kind} with id {raw_id}.")


def _json_body(request: httpx.Request) -> dict[str, Any]:
    try:
        body = json.loads(request.content or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "Body must be a JSON object.")
    return body
