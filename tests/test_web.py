"""Web env pieces without a browser: action parsing, the AX-tree text, WebArena task configs and evaluators."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from environments.base import InvalidTaskError
from environments.web import axtree, evaluators, grading, program_html, prompt, site_functions
from environments.web.actions import NO_BACKTICKS, Action, ParseError, parse_action
from environments.web.task_configs import SiteNotConfigured, TaskConfigs, original_tasks_path

# -- actions ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("turn,expected", [
    ("Let's think. In summary, the next action I will perform is ```click [1234]```", Action("click", 1234)),
    ("```type [164] [restaurants near CMU] [1]```", Action("type", 164, "restaurants near CMU", 1)),
    ("```type [7] [a [bracketed] text] [0]```", Action("type", 7, "a [bracketed] text", 0)),
    ("```type [7] [enter is the default]```", Action("type", 7, "enter is the default", 1)),
    ("```hover [3]```", Action("hover", 3)),
    ("```press [ctrl+a]```", Action("press", text="Control+a")),
    ("```scroll [direction=down]```", Action("scroll", text="down")),
    ("```scroll [up]```", Action("scroll", text="up")),
    ("```new_tab```", Action("new_tab")),
    ("```tab_focus [2]```", Action("tab_focus", number=2)),
    ("```close_tab```", Action("close_tab")),
    ("```goto [http://x.org/a?b=1]```", Action("goto", text="http://x.org/a?b=1")),
    ("```go_back```", Action("go_back")),
    ("```go_forward```", Action("go_forward")),
    ("```stop [$189.00]```", Action("stop", text="$189.00")),
    ("```stop []```", Action("stop", text="")),
    ("```\nclick [5]\n```", Action("click", 5)),
    ("first ```click [1]``` then ```click [2]```", Action("click", 1)),  # the first block counts, as in WebArena
])
def test_actions_parse_like_webarena(turn, expected):
    assert parse_action(turn) == expected


def test_action_text_round_trips():
    for action in [Action("type", 3, "hi", 0), Action("tab_focus", number=1), Action("stop", text="x"),
                   Action("go_back"), Action("click", 9)]:
        assert parse_action(f"```{action}```") == action


@pytest.mark.parametrize("turn,message", [
    ("click [12]", NO_BACKTICKS),
    ("```click [abc]```", "click needs one element id"),
    ("```type [12]```", "type needs an element id and the text"),
    ("```scroll [left]```", "scroll needs a direction"),
    ("```tab_focus [x]```", "tab_focus needs a tab index"),
    ("```goto []```", "goto needs a URL"),
    ("```fly [3]```", "unknown action 'fly'"),
])
def test_unparsable_actions_say_why(turn, message):
    with pytest.raises(ParseError, match=message.replace("(", r"\(").replace(")", r"\)")[:40]):
        parse_action(turn)


def test_observation_layout_is_webarenas():
    text = prompt.observation("Tab 0 (current): Shop", "[1] RootWebArea 'Shop'", "http://a/", "Buy", "None")
    assert text == ("OBSERVATION:\nTab 0 (current): Shop\n\n[1] RootWebArea 'Shop'\nURL: http://a/\nOBJECTIVE: Buy\n"
                    "PREVIOUS ACTION: None")
    assert prompt.observation("t", "x", "u", "o", "p", note="bad").startswith("bad\n\nOBSERVATION:")
    assert "```" in prompt.INSTRUCTION and "stop [answer]" in prompt.INSTRUCTION


# -- accessibility tree text ------------------------------------------------------------------------------


def _node(node_id, role, name="", children=(), backend=None, props=(), ignored=False):
    return {"nodeId": str(node_id), "role": {"value": role}, "name": {"value": name}, "ignored": ignored,
            "childIds": [str(c) for c in children], "backendDOMNodeId": backend or node_id,
            "properties": [{"name": k, "value": {"value": v}} for k, v in props]}


NODES = [
    _node(1, "RootWebArea", "Shop", [2, 5], props=[("focused", True), ("url", "http://a/")]),
    _node(2, "generic", "", [3, 4]),
    _node(3, "link", "Home", [6]),
    _node(4, "textbox", "Search", props=[("focusable", True), ("required", False)]),
    _node(5, "button", "Far below"),
    _node(6, "StaticText", "Home"),
]


def test_tree_lines_drop_layout_nodes_and_repeated_text():
    tree = axtree.render(NODES, None, (0, 0, 0, 0), max_tokens=500)
    assert tree.text.splitlines() == [
        "[1] RootWebArea 'Shop' focused: True", "\t[2] link 'Home'", "\t[3] textbox 'Search' required: False",
        "\t[4] button 'Far below'"]
    assert tree.backend == {1: 1, 2: 3, 3: 4, 4: 5} and tree.truncated_lines == 0


def test_ids_follow_tree_order_not_the_browsers_node_ids():
    shifted = [dict(node, backendDOMNodeId=node["backendDOMNodeId"] + 500) for node in NODES]
    assert axtree.render(shifted, None, (0, 0, 0, 0), 500).text == axtree.render(NODES, None, (0, 0, 0, 0), 500).text
    ids = axtree.IdMap()
    first = axtree.render(NODES, None, (0, 0, 0, 0), 500, ids)
    fewer = [n for n in NODES if n["nodeId"] != "3"]
    fewer[0] = dict(fewer[0], childIds=["2", "5"])
    fewer[1] = dict(fewer[1], childIds=["4"])
    second = axtree.render(fewer, None, (0, 0, 0, 0), 500, ids)
    assert second.nodes[3] == first.nodes[3] == "textbox 'Search' required: False"  # an element keeps its id
    assert second.backend == {k: v for k, v in first.backend.items() if k != 2}


def test_viewport_only_drops_nodes_outside_the_viewport():
    boxes = {1: (0, 0, 1280, 3000), 3: (0, 10, 50, 20), 4: (0, 40, 100, 20), 5: (0, 2000, 100, 20)}
    tree = axtree.render(NODES, boxes, (0, 0, 1280, 720), max_tokens=500)
    assert "Far below" not in tree.text and "Search" in tree.text
    scrolled = axtree.render(NODES, boxes, (0, 1500, 1280, 720), max_tokens=500)
    assert "Far below" in scrolled.text and "link 'Home'" not in scrolled.text


def test_observation_is_capped_in_tokens():
    many = [_node(1, "RootWebArea", "Big", list(range(2, 402)))] + [
        _node(i, "button", f"button number {i}") for i in range(2, 402)]
    tree = axtree.render(many, None, (0, 0, 0, 0), max_tokens=200)
    body = tree.text.rsplit("\n", 1)[0]
    assert axtree.approx_tokens(body) <= 200 and tree.truncated_lines > 300
    assert "more lines cut to fit 200 tokens" in tree.text


# -- WebArena task configs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def originals():
    return TaskConfigs(original_tasks_path(), sites={"shopping": "http://shop:7770/", "gitlab": "http://git:8023"})


def test_the_812_original_tasks_load_with_disjoint_splits(originals):
    train, test = originals.tasks("train"), originals.tasks("test")
    assert len(train) + len(test) == 812 and 100 < len(test) < 250
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    templates = {split: {originals.raw(t.task_id)["intent_template_id"] for t in tasks}
                 for split, tasks in (("train", train), ("test", test))}
    assert not templates["train"] & templates["test"]  # whole templates are held out
    with pytest.raises(InvalidTaskError):
        originals.raw(812)


def test_placeholders_and_login_state_resolve_from_config_and_environment(originals, monkeypatch, tmp_path):
    map_task = next(c for c in originals.configs if c["sites"] == ["map"])
    with pytest.raises(SiteNotConfigured, match="WA_MAP=http://host:port"):
        originals.resolved(int(map_task["task_id"]))
    monkeypatch.setenv("WA_MAP", "http://maps:3000/")
    assert originals.resolved(int(map_task["task_id"]))["start_url"].startswith("http://maps:3000")
    shopping = next(c for c in originals.configs if c["sites"] == ["shopping"] and "__SHOPPING__" in json.dumps(c["eval"]))
    monkeypatch.setenv("WEBARENA_AUTH_DIR", str(tmp_path))
    with pytest.raises(SiteNotConfigured, match="login state"):
        originals.resolved(int(shopping["task_id"]))
    (tmp_path / "shopping_state.json").write_text('{"cookies": [], "origins": []}')
    resolved = originals.resolved(int(shopping["task_id"]))
    assert resolved["storage_state"] == str(tmp_path / "shopping_state.json")
    assert resolved["start_url"].startswith("http://shop:7770") and "__SHOPPING__" not in json.dumps(resolved)


def test_every_program_html_locator_of_the_dataset_parses(originals):
    count = 0
    for config in originals.configs:
        for check in config["eval"].get("program_html") or []:
            if not check["locator"].startswith("func:"):
                program_html.parse_locator(check["locator"])
                count += 1
            else:
                assert site_functions.parse_call(check["locator"])[0] in (
                    "gitlab_get_project_memeber_role", "shopping_get_sku_latest_review_rating",
                    "shopping_get_sku_latest_review_author")
    assert count > 600


def test_locators_become_data_and_unknown_forms_are_refused():
    terms = program_html.parse_locator(
        "document.querySelector('#a').lastElementChild.querySelector(\".b\").outerText + ' ' + "
        "(document.querySelectorAll('li')[2]?.value || 'none')")
    assert terms == [
        {"steps": [{"op": "qs", "sel": "#a"}, {"op": "child", "name": "lastElementChild"},
                   {"op": "qs", "sel": ".b"}], "prop": "outerText", "optional": False},
        {"literal": " "},
        {"steps": [{"op": "qsa", "sel": "li", "index": 2}], "prop": "value", "optional": True, "default": "none"}]
    for bad in ["window.location.href", "document.querySelector('a').click()", "fetch('/x').then(r => r.text())"]:
        with pytest.raises(program_html.LocatorError):
            program_html.parse_locator(bad)


def test_site_functions():
    assert site_functions.reddit_get_post_url("http://f/f/books/124/some-title/comment/9") == "http://f/f/books/124/"
    assert site_functions.url_function("func:reddit_get_post_url('__last_url__')", "http://f/wiki", None) == "http://f/wiki"
    with pytest.raises(site_functions.FunctionError, match="configure the 'shopping' site"):
        site_functions.locator_function("func:shopping_get_sku_latest_review_author('B0')", None,
                                        site_functions.SiteAccess())
    with pytest.raises(site_functions.FunctionError):
        site_functions.url_function("func:__import__('os')", "", None)


# -- evaluators ---------------------------------------------------------------------------------------------


def test_string_checks():
    assert evaluators.string_score({"exact_match": "Quest Band"}, " 'quest band' ", "", "", None) == 1.0
    assert evaluators.string_score({"exact_match": "Quest Band"}, "Quest Band Pro", "", "", None) == 0.0
    assert evaluators.string_score({"must_include": ["pittsburgh", "PA"]}, "Pittsburgh, PA 15213", "", "", None) == 1.0
    assert evaluators.string_score({"must_include": ["0"]}, "10 items", "", "", None) == 0.0  # one token: whole word
    assert evaluators.string_score({"must_include": ["0"]}, "0 items", "", "", None) == 1.0
    assert evaluators.string_score({"fuzzy_match": "N/A"}, "N/A", "", "", None) == 1.0


def test_fuzzy_match_without_a_judge_is_unavailable_never_a_verdict():
    with pytest.raises(evaluators.JudgeUnavailable, match="judge"):
        evaluators.string_score({"fuzzy_match": ["about 3 km"]}, "3 km", "how far?", "", None)
    config = {"task_id": 1, "eval": {"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": ["x"]}}}
    with pytest.raises(grading.EvaluationUnavailable, match="WEBARENA_JUDGE_URL"):
        grading.check_gradable(config, None)


def test_fuzzy_match_asks_the_judge():
    verdicts = []

    class Judge(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt_text = body["messages"][-1]["content"]
            verdicts.append(prompt_text)
            reply = "correct" if "student answer: 3 km" in prompt_text else "incorrect"
            data = json.dumps({"choices": [{"message": {"content": f"Verdict: {reply}"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judge = evaluators.Judge(url=f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions")
        answers = {"fuzzy_match": ["about 3 km"]}
        assert evaluators.string_score(answers, "3 km", "How far is it?", "", judge) == 1.0
        assert evaluators.string_score(answers, "12 km", "How far is it?", "", judge) == 0.0
        assert len(verdicts) == 2 and "reference answer: about 3 km" in verdicts[0]
    finally:
        server.shutdown()
        server.server_close()


def test_url_match_is_gold_in_pred():
    assert evaluators.url_score("http://a/b/c", "http://a/b/c/") == 1.0
    assert evaluators.url_score("http://a/search?q=tea", "http://a/search?q=tea&page=2") == 1.0
    assert evaluators.url_score("http://a/search?q=tea", "http://a/search?q=mug") == 0.0
    assert evaluators.url_score("http://a/x |OR| http://a/y", "http://a/y") == 1.0
    assert evaluators.url_score("http://a/order/", "http://a/order/7") == 1.0
    assert evaluators.url_score("http://a/order/", "http://a/cart") == 0.0


def test_required_contents():
    assert evaluators.contents_score({"exact_match": "lgtm"}, "LGTM") == 1.0
    assert evaluators.contents_score({"must_include": ["Guest |OR| Reporter"]}, "role: Reporter") == 1.0
    assert evaluators.contents_score({"must_include": ["a", "zz"]}, "abc") == 0.0


def test_evaluation_multiplies_its_checks():
    config = {"task_id": 3, "intent": "x", "eval": {
        "eval_types": ["string_match", "url_match", "program_html"], "reference_answers": {"must_include": ["9"]},
        "reference_url": "http://s/p", "program_html": [{"url": "last", "locator": "", "required_contents": {
            "must_include": ["ok"]}}]}}
    passing = evaluators.evaluate(config, "9 items", "http://s/p", lambda check: "all ok", None)
    assert passing.score == 1.0 and passing.details["program_html[0]"]["score"] == 1.0
    assert evaluators.evaluate(config, "9 items", "http://s/q", lambda check: "all ok", None).score == 0.0
    assert evaluators.evaluate(config, "9 items", "http://s/p", lambda check: "bad", None).score == 0.0
