"""A mocked shop API (auth, customers, paginated orders, products) over seeded data.

    with mock_apis.shop.mocked(seed=1) as api:
        httpx.get(f"{api.base_url}/customers", params={"name": "Keller"})
"""

from __future__ import annotations

from cgym.mock_apis.shop.data import Customer, Order, OrderItem, Product, ShopData, generate_shop
from cgym.mock_apis.shop.service import (
    BASE_URL,
    MAX_PER_PAGE,
    RequestRecord,
    ShopService,
    access_token,
    default_credentials,
    mocked,
)

__all__ = [
    "BASE_URL",
    "MAX_PER_PAGE",
    "Customer",
    "Order",
    "OrderItem",
    "Product",
    "RequestRecord",
    "ShopData",
    "ShopService",
    "access_token",
    "default_credentials",
    "generate_shop",
    "mocked",
]
