"""Mocked HTTP services (httpx + respx) over seeded in-memory data, with seeded fault injection.

A service is usable on its own to exercise any HTTP agent, or through `ShopService.client()`
by an env, without patching httpx globally. This package depends on neither `envs` nor torch.
"""

from __future__ import annotations

from cgym.mock_apis import shop
from cgym.mock_apis.faults import FAULT_KINDS, Fault, FaultKind, FaultPlan, faulty_response

__all__ = ["FAULT_KINDS", "Fault", "FaultKind", "FaultPlan", "faulty_response", "shop"]
