"""Deep Search (searchqa): answer scoring, the generated set, bm25 retrieval, the env's turns and errors,
the Search-R1 retrieval server and client, FlashRAG files, the worker pool, the AgentGym protocol, a tiny run."""

from __future__ import annotations

import json
import random

import pytest
import requests

from environments.base import EnvError, InvalidTaskError, make_env
from environments.searchqa import env as searchqa_env
from environments.searchqa.answers import exact_match, f1_score, normalize_answer
from environments.searchqa.corpus import CorpusError, JsonlCorpus, Passage, write_corpus
from environments.searchqa.dataset import prepare_generated, read_questions
from environments.searchqa.flashrag import load_flashrag
from environments.searchqa.knowledge import KINDS
from environments.searchqa.retrieval import (RetrievalError, build_bm25_index, format_information,
                                             make_retriever)
from tests.test_env_http import _free_port, _serve, running_server


@pytest.fixture(scope="module")
def generated():
    directory = prepare_generated(0)
    return directory, read_questions(directory / "questions.jsonl")


@pytest.fixture(scope="module")
def env():
    environment = make_env("searchqa")
    yield environment
    environment.close()


def test_answer_normalization_and_scores():
    assert normalize_answer("  The Euro!! ") == "euro"
    assert normalize_answer("A Tale of an Apple") == "tale of apple"
    assert exact_match("The United States.", ["United States", "USA"]) == 1.0
    assert exact_match("united-states", ["United States"]) == 0.0  # punctuation is dropped, not made a space
    assert exact_match("United States of America", ["United States"]) == 0.0
    assert f1_score("united states of america", ["United States"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1_score("", ["x"]) == 0.0


def test_generated_set_is_deterministic_split_by_id_and_every_answer_is_stated(generated):
    directory, questions = generated
    from environments.searchqa.knowledge import generate

    passages, again = generate(0)
    assert [q.to_row() for q in again] == [q.to_row() for q in questions]
    test = [q for q in questions if q.split == "test"]
    train = [q for q in questions if q.split == "train"]
    assert 2500 <= len(questions) <= 6000 and len(test) == int(len(questions) * 0.2)
    assert max(q.item_id for q in test) < min(q.item_id for q in train)  # test ids first, then train
    assert {q.question for q in test}.isdisjoint(q.question for q in train)
    for split in (test, train):
        assert {q.subtask for q in split} == set(KINDS)
    by_id = {p.doc_id: p for p in passages}
    for q in random.Random(0).sample(questions, 300):
        final_hop = q.gold_doc_ids[-1]
        assert all(doc in by_id for hop in q.gold_doc_ids for doc in hop)
        if q.subtask != "comparison":  # a comparison's answer is read from two pages' numbers
            assert any(normalize_answer(a) in normalize_answer(by_id[d].contents)
                       for a in q.golden_answers for d in final_hop), q
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["passages"] == len(passages) > 30_000 and manifest["questions"] == len(questions)


def test_bm25_finds_the_gold_passage_of_single_hop_questions(generated):
    directory, questions = generated
    retriever = make_retriever("bm25", index_dir=directory / "bm25")
    single = [q for q in questions if q.subtask == "single-hop"][:400]
    hits = retriever.search([q.question for q in single], 3)
    found = [bool({h.passage.doc_id for h in row} & set(q.gold_doc_ids[0])) for q, row in zip(single, hits)]
    assert sum(found) / len(found) >= 0.95
    assert all(len(row) == 3 and row[0].score >= row[1].score >= row[2].score for row in hits)
    assert retriever.search(["qqqzzz xxyyzz"], 3) == [[]]  # nothing known: no hits, no error
    retriever.close()


def test_bm25_index_on_a_user_corpus_and_its_errors(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus([Passage("a", "Alpha", "alpha is first"), Passage("b", "Beta", "beta is second")], corpus)
    build_bm25_index(corpus, tmp_path / "index")
    retriever = make_retriever("bm25", index_dir=tmp_path / "index")
    top = retriever.search(["second letter beta"], 5)[0]
    assert [h.passage.doc_id for h in top] == ["b"]
    assert format_information(top) == '<information>Doc 1(Title: "Beta") beta is second\n</information>'
    retriever.close()
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("user data")
    with pytest.raises(RetrievalError, match="not a bm25 index of ours"):
        build_bm25_index(corpus, tmp_path / "keep")
    assert (tmp_path / "keep" / "mine.txt").read_text() == "user data"
    with pytest.raises(RetrievalError, match="is not a bm25 index; build one"):
        make_retriever("bm25", index_dir=tmp_path)
    corpus.write_text(corpus.read_text() + '{"id": "c", "contents": "\\"Gamma\\"\\ngamma"}\n')
    with pytest.raises(RetrievalError, match="has changed since indexing; rebuild"):
        make_retriever("bm25", index_dir=tmp_path / "index")
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: not a wiki-18 corpus row"):
        build_bm25_index(tmp_path / "bad.jsonl", tmp_path / "index2")


def test_corpus_rows_are_read_by_offset(tmp_path):
    rows = [Passage(str(i), f"T{i}", "x" * i + " é") for i in range(50)]
    write_corpus(rows, tmp_path / "c.jsonl")
    corpus = JsonlCorpus(tmp_path / "c.jsonl", tmp_path / "offsets" / "o.npy")
    assert len(corpus) == 50 and corpus[0] == rows[0] and corpus[49] == rows[49] and corpus[17] == rows[17]
    with pytest.raises(IndexError):
        corpus[50]
    corpus.close()


def test_scripted_agent_with_gold_queries_answers_every_kind(env, generated):
    _, questions = generated
    rng = random.Random(1)
    for kind in KINDS:
        chosen = rng.sample([q for q in questions if q.subtask == kind and q.split == "test"], 8)
        found_hops = 0
        for q in chosen:
            observation, info = env.reset(q.item_id)
            assert observation == f"Question: {q.question}" and info["subtask"] == kind
            for hop, query in enumerate(q.gold_queries):
                result = env.step(f"<think>I need hop {hop}.</think>\n<search> {query} </search>")
                assert result.observation.startswith("<information>Doc 1(Title: ") and not result.done
                assert result.info["action_valid"] and 1 <= len(result.info["retrieved_doc_ids"]) <= 3
                found_hops += bool(set(result.info["retrieved_doc_ids"]) & set(q.gold_doc_ids[hop]))
            result = env.step(f"<think>done</think><answer> {q.golden_answers[-1]} </answer>")
            assert (result.reward, result.done, result.info["em"], result.info["success"]) == (1.0, True, 1.0, True)
            assert result.observation == searchqa_env.CORRECT
        assert found_hops >= 0.85 * sum(len(q.gold_queries) for q in chosen), kind


def test_malformed_turns_get_messages_and_the_episode_goes_on(env, generated):
    _, questions = generated
    q = questions[0]
    env.reset(q.item_id)
    cases = [
        ("no tags at all", searchqa_env.INVALID_FORMAT),
        ("<search>mismatched</answer>", searchqa_env.INVALID_FORMAT),
        ("<search>   </search>", "Your search query is empty"),
        ("<search>" + "x" * 100_000 + "</search>", "Your search query is too long (100000 characters"),
        ("<answer>certainly not this</answer>", searchqa_env.WRONG),
    ]
    for turn, expected in cases:
        result = env.step(turn)
        assert result.observation.startswith(expected) and (result.reward, result.done) == (0.0, False), turn
    first = env.step("<answer>wrong</answer> then <answer>" + q.golden_answers[0] + "</answer>")
    assert first.done and first.info["answer"] == q.golden_answers[0]  # the turn's last answer counts
    with pytest.raises(InvalidTaskError, match="not in the generated set"):
        env.reset(10**7)


def test_a_retriever_that_is_down_is_an_observation_not_a_lost_episode(generated):
    port = _free_port()  # nothing listens there
    environment = make_env("searchqa", retriever_url=f"http://127.0.0.1:{port}")
    q = generated[1][0]
    environment.reset(q.item_id)
    result = environment.step("<search>France</search>")
    assert result.observation.startswith("The search engine is unavailable") and not result.done
    assert "did not answer after 3 tries" in result.info["search_error"]
    assert "launch.serve_retriever" in result.info["search_error"]
    assert environment.step(f"<answer>{q.golden_answers[0]}</answer>").reward == 1.0
    environment.close()
    with pytest.raises(EnvError, match="retriever='dense' needs dense_corpus, dense_encoder"):
        make_env("searchqa", retriever="dense", dense_index="x.index")
    with pytest.raises(EnvError, match="unknown searchqa dataset"):
        make_env("searchqa", dataset="nq")


@pytest.fixture(scope="module")
def retriever_url(generated):
    with running_server("launch.serve_retriever") as (url, _):
        yield url


def test_search_r1_requests_and_our_client(retriever_url, generated):
    directory, _ = generated
    body = requests.post(retriever_url + "/retrieve",
                         json={"queries": ["capital of Japan", "Tokyo"], "topk": 3, "return_scores": True}).json()
    assert len(body["result"]) == 2 and len(body["result"][0]) == 3
    first = body["result"][0][0]
    assert set(first) == {"document", "score"} and set(first["document"]) == {"id", "contents"}
    assert first["document"]["contents"].startswith('"') and "\n" in first["document"]["contents"]
    bare = requests.post(retriever_url + "/retrieve", json={"queries": ["Tokyo"], "topk": 2}).json()
    assert set(bare["result"][0][0]) == {"id", "contents"} and len(bare["result"][0]) == 2
    refused = requests.post(retriever_url + "/retrieve", json={"queries": ["x"], "topk": 0})
    assert refused.status_code == 400 and "topk must be in 1..100" in refused.text
    local = make_retriever("bm25", index_dir=directory / "bm25")
    remote = make_retriever("http", url=retriever_url)
    queries = ["currency of Brazil", "Lyon", "calling code of Kenya"]
    assert [[(h.passage, round(h.score, 4)) for h in row] for row in remote.search(queries, 3)] == \
        [[(h.passage, round(h.score, 4)) for h in row] for row in local.search(queries, 3)]
    local.close()
    remote.close()


def test_flashrag_files_keep_the_original_item_ids(tmp_path):
    for dataset, split, n in (("nq", "test", 3), ("nq", "train", 2), ("hotpotqa", "dev", 2), ("hotpotqa", "train", 1)):
        (tmp_path / dataset).mkdir(exist_ok=True)
        (tmp_path / dataset / f"{split}.jsonl").write_text("".join(
            json.dumps({"id": f"{split}_{i}", "question": f"{dataset} {split} q{i}", "golden_answers": [f"a{i}"]})
            + "\n" for i in range(n)))
    questions = load_flashrag(tmp_path, ("nq", "hotpotqa"))
    ids = {(q.split, q.subtask, q.question): q.item_id for q in questions}
    assert ids[("test", "nq", "nq test q2")] == 2 and ids[("test", "hotpotqa", "hotpotqa dev q1")] == 29191
    assert ids[("train", "nq", "nq train q1")] == 51714 and ids[("train", "hotpotqa", "hotpotqa train q0")] == 130881
    with pytest.raises(EnvError, match=r"has no triviaqa/test.jsonl or triviaqa/dev.jsonl.*FlashRAG_datasets"):
        load_flashrag(tmp_path, ("triviaqa",))
    environment = make_env("searchqa", dataset="flashrag", flashrag_dir=str(tmp_path), flashrag_datasets=["nq"],
                           retriever_url="http://127.0.0.1:9")
    assert [t.task_id for t in environment.tasks("test")] == [0, 1, 2]
    assert environment.reset(51713)[0] == "Question: nq train q0"


def test_searchqa_through_the_worker_pool_and_the_agentgym_protocol(generated):
    from environments.agentgym_http import AgentGymHTTPEnv
    from environments.workers import EnvPool

    q = generated[1][5]
    turns = [f"<search>{query}</search>" for query in q.gold_queries] + [f"<answer>{q.golden_answers[0]}</answer>"]
    with EnvPool("searchqa", {}, num_workers=1, step_timeout_s=60.0) as pool:
        start = pool.reset([q.item_id])[0]
        assert start.observation == f"Question: {q.question}"
        outcomes = [pool.step({start.episode_id: turn})[start.episode_id] for turn in turns]
    assert outcomes[0].observation.startswith("<information>") and outcomes[-1].reward == 1.0 and outcomes[-1].done
    for url in _serve("searchqa"):
        client = AgentGymHTTPEnv(base_url=url)
        assert client.reset(q.item_id)[0] == start.observation
        played = [client.step(turn) for turn in turns]
        assert [r.observation for r in played] == [o.observation for o in outcomes]
        assert played[-1].reward == 1.0 and played[-1].done
        client.close()


def test_a_tiny_training_run_on_searchqa_writes_its_reports(tmp_path):
    from agentgym_jax.trainer import train_and_evaluate
    from tests.test_trainer import tiny_config
    from tests.tiny_models import save_tiny_chat_model

    config = tiny_config(save_tiny_chat_model(tmp_path / "model"), tmp_path / "run", steps=2)
    config.env.update(dict(name="searchqa", import_modules=(), num_workers=1))
    config.env.kwargs = dict(top_k=1)
    config.data.update(dict(tasks_per_step=2, samples_per_task=2, validation_tasks=0, test_tasks=4))
    config.rollout.update(dict(max_turn_tokens=8, max_trajectory_tokens=1024, stop_strings=("</search>",)))
    config.eval.batch_tasks = 4
    report = train_and_evaluate(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["n_test_tasks"] == 4 and saved == json.loads(json.dumps(report))
    settings = saved["eval_after"]["settings"]
    assert settings["env"] == "searchqa" and settings["stop_strings"] == ["</search>"]
    assert set(saved["eval_after"]["subtasks"]) <= set(KINDS)
    assert (tmp_path / "run" / "training.png").is_file() and (tmp_path / "run" / "eval_after.md").is_file()


def test_question_records_read_back_as_the_question_set(tmp_path, generated):
    from environments.searchqa.dataset import QuestionSet
    from environments.searchqa.question_records import QuestionRecords, QuestionRecordsError, main

    directory, questions = generated
    out = tmp_path / "generated.array_record"
    main(["--generated", f"--out={out}"])  # the one command, on the generated set
    records, in_memory = QuestionRecords(out), QuestionSet(questions, "memory")
    assert len(records) == len(questions) == 3207
    for split in ("train", "test"):
        assert records.tasks(split) == in_memory.tasks(split)
    for question in random.Random(0).sample(questions, 50):
        assert records[question.item_id] == question
    with pytest.raises(InvalidTaskError, match="item id 10000000 is not in"):
        records[10_000_000]
    records.close()
    records.close()  # twice is fine
    # the env plays from the file, a question at a time
    environment = make_env("searchqa", dataset="records", questions_path=str(out), index_dir=str(directory / "bm25"))
    first = environment.tasks("test")[0]
    assert environment.reset(first.task_id)[0] == f"Question: {in_memory[first.task_id].question}"
    environment.close()
    foreign = tmp_path / "theirs.array_record"
    foreign.write_text("not ours")
    with pytest.raises(QuestionRecordsError, match="was not written by write_question_records"):
        main(["--generated", f"--out={foreign}"])
    assert foreign.read_text() == "not ours"
    with pytest.raises(EnvError, match="dataset='records' needs questions_path"):
        make_env("searchqa", dataset="records")
