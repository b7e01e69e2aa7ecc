"""The ``func:`` helpers WebArena's task files name, implemented explicitly (never ``eval``-ed).

``program_html`` urls: ``func:reddit_get_post_url('__last_url__')`` and ``func:shopping_get_latest_order_url()``;
locators: ``func:gitlab_get_project_memeber_role(__page__, 'user')``,
``func:shopping_get_sku_latest_review_rating('SKU')`` and ``func:shopping_get_sku_latest_review_author('SKU')``.
The shopping ones query the Magento REST API of the shopping site with the admin account (WebArena's
defaults unless configured).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable
from urllib.parse import urlparse

import requests

_CALL = re.compile(r"func:(\w+)\((.*)\)\s*$", re.DOTALL)
_ARG = re.compile(r"""\s*(?:'([^']*)'|"([^"]*)"|(__page__))\s*(?:,|$)""")
_ROLE_JS = """(account) => {
  const names = [...document.querySelectorAll("td[data-label='Account'] span.gl-avatar-labeled-sublabel")];
  const index = names.findIndex((el) => el.outerText === '@' + account);
  const roles = document.querySelectorAll('td.col-max-role span');
  return index >= 0 && roles[index] ? roles[index].outerText : '';
}"""


class FunctionError(ValueError):
    """A ``func:`` form that is unknown or whose site is not configured."""


@dataclasses.dataclass
class SiteAccess:
    """What the shopping helpers need: the shopping URL and the Magento admin account."""

    shopping_url: str = ""
    admin_user: str = "admin"
    admin_password: str = "admin1234"
    timeout_s: float = 20.0


def parse_call(text: str) -> tuple[str, list[str]]:
    """``func:name('a', __page__)`` -> ("name", ["a", "__page__"])."""
    match = _CALL.match(text.strip())
    if match is None:
        raise FunctionError(f"not a func: call: {text!r}")
    args, rest = [], match.group(2).strip()
    while rest:
        arg = _ARG.match(rest)
        if arg is None:
            raise FunctionError(f"unsupported arguments in {text!r}: only quoted strings and __page__")
        args.append(next(g for g in arg.groups() if g is not None))
        rest = rest[arg.end():]
    return match.group(1), args


def reddit_get_post_url(url: str) -> str:
    """``http://host/f/forum/123/slug/...`` -> ``http://host/f/forum/123/``; other urls unchanged."""
    parsed = urlparse(url)
    parts = parsed.path.split("/")
    if len(parts) < 4 or parts[1] != "f":
        return url
    return f"{parsed.scheme}://{parsed.netloc}/f/{parts[2]}/{parts[3]}/"


def _magento(access: SiteAccess, path: str, params: dict | None = None) -> Any:
    if not access.shopping_url:
        raise FunctionError("this check reads the shopping site's REST API: configure the 'shopping' site URL")
    token = requests.post(f"{access.shopping_url}/rest/default/V1/integration/admin/token", timeout=access.timeout_s,
                          json={"username": access.admin_user, "password": access.admin_password})
    token.raise_for_status()
    response = requests.get(f"{access.shopping_url}{path}", params=params, timeout=access.timeout_s,
                            headers={"Authorization": f"Bearer {token.json()}"})
    response.raise_for_status()
    return response.json()


def shopping_get_latest_order_url(access: SiteAccess) -> str:
    params = {"searchCriteria[sortOrders][0][field]": "created_at",
              "searchCriteria[sortOrders][0][direction]": "DESC", "searchCriteria[pageSize]": "1"}
    order = _magento(access, "/rest/V1/orders", params)["items"][0]
    return f"{access.shopping_url}/sales/order/view/order_id/{int(order['increment_id'])}/"


def shopping_get_sku_latest_review_author(access: SiteAccess, sku: str) -> str:
    reviews = _magento(access, f"/rest/V1/products/{sku}/reviews")
    return reviews[-1]["nickname"] if reviews else ""


def shopping_get_sku_latest_review_rating(access: SiteAccess, sku: str) -> str:
    reviews = _magento(access, f"/rest/V1/products/{sku}/reviews")
    return str(reviews[-1]["ratings"][0]["percent"]) if reviews else ""


def url_function(text: str, last_url: str, access: SiteAccess) -> str:
    """The URL a ``func:`` url form names."""
    name, args = parse_call(text)
    if name == "reddit_get_post_url" and len(args) == 1:
        return reddit_get_post_url(last_url if args[0] == "__last_url__" else args[0])
    if name == "shopping_get_latest_order_url" and not args:
        return shopping_get_latest_order_url(access)
    raise FunctionError(f"unknown program_html url function {text!r}")


def locator_function(text: str, evaluate: Callable[[str, Any], Any], access: SiteAccess) -> str:
    """The value a ``func:`` locator form reads; ``evaluate(js, arg)`` runs fixed JS in the page."""
    name, args = parse_call(text)
    if name == "gitlab_get_project_memeber_role" and len(args) == 2 and args[0] == "__page__":
        return str(evaluate(_ROLE_JS, args[1]) or "")
    if name == "shopping_get_sku_latest_review_rating" and len(args) == 1:
        return shopping_get_sku_latest_review_rating(access, args[0])
    if name == "shopping_get_sku_latest_review_author" and len(args) == 1:
        return shopping_get_sku_latest_review_author(access, args[0])
    raise FunctionError(f"unknown program_html locator function {text!r}")
