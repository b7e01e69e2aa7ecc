"""Corner Shop: a small web shop on SQLite, served on 127.0.0.1 from a thread of the environment's process.

Pages: home, categories, search, product pages with reviews and a review form, a cart kept in a cookie,
checkout to an order page, login, and an account page with newsletter settings. ``reset()`` restores the
seeded database, so every episode starts from the same state (WebArena's ``require_reset``).
Login sessions are signed cookies (HMAC of the user name), so they survive a reset.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import html
import http.server
import secrets
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlparse

from environments.web.localshop import catalog

STYLE = ("body{font-family:sans-serif;margin:0}header{background:#234;padding:8px}header a,header button{color:#fff}"
         "main{padding:12px}table{border-collapse:collapse}td,th{padding:4px 8px;border:1px solid #ccc}")


def _money(cents: int) -> str:
    return f"${cents / 100:.2f}"


class Shop:
    """The shop's state (database file, signing key) and its HTTP server."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="agentgym-localshop-")
        self.db_path = str(Path(self._dir.name) / "shop.sqlite")
        self.key = secrets.token_bytes(16)
        self.lock = threading.Lock()
        catalog.seed(self.db_path)
        handler = type("Handler", (_Handler,), {"shop": self})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="localshop", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Restores the seeded database."""
        with self.lock:
            catalog.seed(self.db_path)

    def query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self.lock, contextlib.closing(sqlite3.connect(self.db_path)) as db, db:
            db.row_factory = sqlite3.Row
            return db.execute(sql, args).fetchall()

    def sign(self, username: str) -> str:
        return username + "." + hmac.new(self.key, username.encode(), hashlib.sha256).hexdigest()[:32]

    def user_of(self, token: str) -> str | None:
        username, _, _ = token.rpartition(".")
        return username if username and hmac.compare_digest(self.sign(username), token) else None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._dir.cleanup()


class _Handler(http.server.BaseHTTPRequestHandler):
    shop: Shop

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    # -- plumbing ----------------------------------------------------------------------------------------

    def _cookies(self) -> dict[str, str]:
        pairs = [c.strip().split("=", 1) for c in self.headers.get("Cookie", "").split(";") if "=" in c]
        return {k: unquote(v) for k, v in pairs}

    def _user(self) -> str | None:
        return self.shop.user_of(self._cookies().get("session", ""))

    def _form(self) -> dict[str, str]:
        length = int(self.headers.get("Content-Length") or 0)
        return {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}

    def _send(self, body: str, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _redirect(self, location: str, cookie: str | None = None) -> None:
        headers = {"Location": location}
        if cookie is not None:
            headers["Set-Cookie"] = cookie
        self._send("", 303, headers)

    def _page(self, title: str, body: str) -> None:
        user = self._user()
        nav = "".join(f'<a href="/category/{slug}">{name}</a> ' for slug, name in catalog.CATEGORIES)
        account = f'<a href="/account">My account ({html.escape(user)})</a>' if user else '<a href="/login">Sign in</a>'
        self._send(f"<!DOCTYPE html><html><head><title>{html.escape(title)} - Corner Shop</title><style>{STYLE}"
                   f'</style></head><body><header><a href="/">Corner Shop</a> <nav>{nav}</nav>'
                   '<form action="/search" role="search"><input name="q" aria-label="Search products">'
                   f'<button type="submit">Search</button></form> <a href="/cart">Cart</a> {account}</header>'
                   f"<main><h1>{html.escape(title)}</h1>{body}</main></body></html>")

    def _product_table(self, rows: list[sqlite3.Row]) -> str:
        if not rows:
            return "<p>No products found.</p>"
        lines = "".join(f'<tr><td><a href="/product/{r["sku"]}">{html.escape(r["name"])}</a></td>'
                        f'<td>{_money(r["price_cents"])}</td></tr>' for r in rows)
        return f"<table><tr><th>Product</th><th>Price</th></tr>{lines}</table>"

    # -- routes ------------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/") if p]
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if not parts:
            rows = self.shop.query("SELECT * FROM products ORDER BY sku LIMIT 4")
            self._page("Welcome", "<h2>Featured</h2>" + self._product_table(rows))
        elif parts[0] == "category" and len(parts) == 2:
            found = [t for s, t in catalog.CATEGORIES if s == parts[1]]
            if not found:
                return self._page("Not found", "<p>No such category.</p>")
            rows = self.shop.query("SELECT * FROM products WHERE category = ? ORDER BY name", (parts[1],))
            self._page(found[0], f"<p>{len(rows)} products</p>" + self._product_table(rows))
        elif parts == ["search"]:
            term = query.get("q", "")
            rows = self.shop.query("SELECT * FROM products WHERE name LIKE ? OR description LIKE ? ORDER BY name",
                                   (f"%{term}%", f"%{term}%"))
            self._page(f"Search results for {term}", self._product_table(rows))
        elif parts[0] == "product" and len(parts) == 2:
            self._product(parts[1])
        elif parts == ["cart"]:
            self._cart()
        elif parts[0] == "order" and len(parts) == 2 and parts[1].isdigit():
            self._order(int(parts[1]))
        elif parts == ["login"]:
            self._page("Sign in", '<form method="post" action="/login"><label>Username <input name="username">'
                       '</label> <label>Password <input name="password" type="password"></label> '
                       '<button type="submit">Sign in</button></form>')
        elif parts[0] == "account":
            self._account(parts[1:])
        else:
            self._send("<h1>Not found</h1>", 404)

    def do_POST(self) -> None:  # noqa: N802
        parts = [p for p in urlparse(self.path).path.strip("/").split("/") if p]
        form = self._form()
        if parts == ["login"]:
            if form.get("username") == catalog.CUSTOMER["username"] and form.get("password") == catalog.CUSTOMER[
                    "password"]:
                return self._redirect("/account", f"session={quote(self.shop.sign(form['username']))}; Path=/")
            return self._page("Sign in", "<p role=\"alert\">Wrong username or password.</p>")
        if parts == ["cart", "add"]:
            cart = self._cart_items()
            quantity = int(form.get("quantity") or 1) if (form.get("quantity") or "1").isdigit() else 1
            cart[form.get("sku", "")] = cart.get(form.get("sku", ""), 0) + max(1, quantity)
            value = ",".join(f"{sku}:{n}" for sku, n in cart.items() if sku)
            return self._redirect("/cart", f"cart={quote(value)}; Path=/")
        if parts == ["checkout"]:
            return self._checkout()
        if len(parts) == 3 and parts[0] == "product" and parts[2] == "review":
            rating = int(form["rating"]) if form.get("rating", "").isdigit() else 0
            if not form.get("nickname") or not form.get("text") or not 1 <= rating <= 5:
                return self._page("Review not saved", "<p role=\"alert\">Give a nickname, a rating and a text.</p>")
            self.shop.query("INSERT INTO reviews (sku, author, rating, body) VALUES (?, ?, ?, ?)",
                            (parts[1], form["nickname"], rating, form["text"]))
            return self._redirect(f"/product/{parts[1]}")
        if parts == ["account", "newsletter"] and self._user():
            self.shop.query("UPDATE settings SET newsletter = ? WHERE username = ?",
                            (1 if form.get("newsletter") else 0, self._user()))
            return self._redirect("/account/newsletter?saved=1")
        self._send("<h1>Not found</h1>", 404)

    # -- pages -------------------------------------------------------------------------------------------

    def _product(self, sku: str) -> None:
        rows = self.shop.query("SELECT * FROM products WHERE sku = ?", (sku,))
        if not rows:
            return self._page("Not found", "<p>No such product.</p>")
        p = rows[0]
        reviews = self.shop.query("SELECT * FROM reviews WHERE sku = ? ORDER BY id", (sku,))
        items = "".join(f'<article class="review"><p class="review-author">{html.escape(r["author"])}</p>'
                        f'<p class="review-rating">{r["rating"]} out of 5</p>'
                        f'<p class="review-text">{html.escape(r["body"])}</p></article>' for r in reviews)
        options = "".join(f'<option value="{n}">{n} stars</option>' for n in range(5, 0, -1))
        self._page(p["name"], f'<p class="price">Price: {_money(p["price_cents"])}</p><p>SKU {p["sku"]}</p>'
                   f'<p>{html.escape(p["description"])}</p><form method="post" action="/cart/add">'
                   f'<input type="hidden" name="sku" value="{p["sku"]}"><label>Quantity <input name="quantity" '
                   'value="1" size="3"></label> <button type="submit">Add to cart</button></form>'
                   f'<h2>Reviews</h2><section id="reviews">{items}</section><h2>Write a review</h2>'
                   f'<form method="post" action="/product/{p["sku"]}/review"><label>Nickname <input name="nickname">'
                   f'</label> <label>Rating <select name="rating">{options}</select></label> <label>Review '
                   '<textarea name="text"></textarea></label> <button type="submit">Submit review</button></form>')

    def _cart_items(self) -> dict[str, int]:
        items: dict[str, int] = {}
        for entry in self._cookies().get("cart", "").split(","):
            sku, _, count = entry.partition(":")
            if sku and count.isdigit():
                items[sku] = items.get(sku, 0) + int(count)
        return items

    def _cart(self) -> None:
        items = self._cart_items()
        if not items:
            return self._page("Your cart", "<p>Your cart is empty.</p>")
        names = {r["sku"]: r for r in self.shop.query("SELECT * FROM products")}
        lines = "".join(f"<tr><td>{html.escape(names[s]['name'])}</td><td>{n}</td></tr>" for s, n in items.items()
                        if s in names)
        self._page("Your cart", f"<table><tr><th>Product</th><th>Quantity</th></tr>{lines}</table>"
                   '<form method="post" action="/checkout"><button type="submit">Place order</button></form>')

    def _checkout(self) -> None:
        items = self._cart_items()
        if not items:
            return self._page("Your cart", "<p>Your cart is empty.</p>")
        with self.shop.lock, contextlib.closing(sqlite3.connect(self.shop.db_path)) as db, db:
            order_id = db.execute("INSERT INTO orders (customer) VALUES (?)", (self._user() or "guest",)).lastrowid
            db.executemany("INSERT INTO order_lines VALUES (?, ?, ?)", [(order_id, s, n) for s, n in items.items()])
        self._redirect(f"/order/{order_id}", "cart=; Path=/")

    def _order(self, order_id: int) -> None:
        lines = self.shop.query("SELECT p.name, l.quantity FROM order_lines l JOIN products p ON p.sku = l.sku "
                                "WHERE l.order_id = ?", (order_id,))
        if not lines:
            return self._page("Not found", "<p>No such order.</p>")
        items = "".join(f"<li>{html.escape(r['name'])}, Quantity: {r['quantity']}</li>" for r in lines)
        self._page(f"Order {order_id}", f'<div class="order-summary"><p>Thank you for your order.</p><ul>{items}'
                   "</ul></div>")

    def _account(self, rest: list[str]) -> None:
        user = self._user()
        if not user:
            return self._redirect("/login")
        if rest == ["newsletter"]:
            on = self.shop.query("SELECT newsletter FROM settings WHERE username = ?", (user,))[0]["newsletter"]
            return self._page("Newsletter", '<form method="post" action="/account/newsletter"><label><input '
                              f'type="checkbox" name="newsletter" value="1"{" checked" if on else ""}> Subscribe to '
                              'the weekly newsletter</label> <button type="submit">Save</button></form>')
        self._page("My account", f"<p>Signed in as {html.escape(catalog.CUSTOMER['name'])}.</p>"
                   '<ul><li><a href="/account/newsletter">Newsletter settings</a></li></ul>')
