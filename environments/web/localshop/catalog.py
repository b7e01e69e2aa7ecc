"""Corner Shop's seeded data: categories, products, reviews and the customer account (written to SQLite)."""

from __future__ import annotations

import contextlib
import os
import sqlite3

CUSTOMER = {"username": "emma", "password": "pinecone-42", "name": "Emma Lopez"}

CATEGORIES = (("kitchen", "Kitchen"), ("garden", "Garden"), ("stationery", "Stationery"), ("home", "Home"))

# sku, name, category, price in cents, description
PRODUCTS = (
    ("KT-101", "Blue Ceramic Mug", "kitchen", 1250, "A 350 ml stoneware mug with a glossy blue glaze."),
    ("KT-102", "Linen Tea Towel", "kitchen", 900, "Natural linen, 50 x 70 cm, hangs from a cotton loop."),
    ("KT-103", "Loose Leaf Tea Tin", "kitchen", 1475, "An airtight tin holding 100 g of tea leaves."),
    ("KT-104", "Oak Cutting Board", "kitchen", 3200, "End-grain oak board, 40 x 28 cm, oiled by hand."),
    ("GD-201", "Copper Watering Can", "garden", 4500, "A 5 litre can with a long spout and a brass rose."),
    ("GD-202", "Bamboo Plant Markers", "garden", 650, "Twenty markers to label seedlings."),
    ("GD-203", "Canvas Kneeling Pad", "garden", 1800, "Water-resistant pad with carry handle."),
    ("ST-101", "Dot Grid Notebook", "stationery", 1100, "A5, 160 pages of 100 gsm paper."),
    ("ST-102", "Brass Pencil Sharpener", "stationery", 700, "A solid brass single-hole sharpener."),
    ("ST-103", "Recycled Paper Envelopes", "stationery", 450, "Pack of 25 C6 envelopes."),
    ("ST-104", "Fountain Pen", "stationery", 2600, "Steel nib, medium, with a converter."),
    ("HM-201", "Wool Throw Blanket", "home", 6900, "Lambswool, 130 x 180 cm, in moss green."),
    ("HM-202", "Walnut Desk Organizer", "home", 2400, "Three compartments for pens, cards and notes."),
    ("HM-203", "Beeswax Candle", "home", 1300, "Hand-poured, burns for about 40 hours."),
)

# sku, author, rating (1-5), text
REVIEWS = (
    ("KT-101", "Noah", 4, "Keeps coffee warm for a while."),
    ("KT-104", "Mia", 5, "Beautiful grain."),
    ("GD-201", "Liam", 5, "Pours evenly, looks great."),
    ("GD-202", "Ava", 3, "Fine, the ink smudges."),
    ("GD-203", "Lucas", 4, "Saves my knees."),
    ("ST-104", "Zoe", 4, "Smooth writer."),
)

SCHEMA = """
CREATE TABLE categories (slug TEXT PRIMARY KEY, title TEXT NOT NULL);
CREATE TABLE products (sku TEXT PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL REFERENCES categories(slug),
                       price_cents INTEGER NOT NULL, description TEXT NOT NULL);
CREATE TABLE reviews (id INTEGER PRIMARY KEY AUTOINCREMENT, sku TEXT NOT NULL REFERENCES products(sku),
                      author TEXT NOT NULL, rating INTEGER NOT NULL, body TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, customer TEXT NOT NULL);
CREATE TABLE order_lines (order_id INTEGER NOT NULL REFERENCES orders(id), sku TEXT NOT NULL, quantity INTEGER NOT NULL);
CREATE TABLE settings (username TEXT PRIMARY KEY, newsletter INTEGER NOT NULL);
"""


def seed(path: str) -> None:
    """(Re)creates the shop's database at ``path`` with the seeded data (atomically replacing any old one)."""
    fresh = f"{path}.new"
    if os.path.exists(fresh):
        os.remove(fresh)
    with contextlib.closing(sqlite3.connect(fresh)) as db, db:
        db.executescript(SCHEMA)
        db.executemany("INSERT INTO categories VALUES (?, ?)", CATEGORIES)
        db.executemany("INSERT INTO products VALUES (?, ?, ?, ?, ?)", PRODUCTS)
        db.executemany("INSERT INTO reviews (sku, author, rating, body) VALUES (?, ?, ?, ?)", REVIEWS)
        db.execute("INSERT INTO settings VALUES (?, 0)", (CUSTOMER["username"],))
    os.replace(fresh, path)
