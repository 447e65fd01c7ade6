"""Where the benches find the shared data: beside the checkout, or where the variable says."""

from __future__ import annotations

from bench.data import REPO_ROOT, passage_texts, shared_data


def test_shared_data_is_beside_the_repository_unless_the_variable_names_a_folder(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("RAGBLEND_SHARED_DATA", raising=False)
    assert shared_data() == REPO_ROOT.parent / "shared" / "data" / "musique_dev.json"
    assert (REPO_ROOT / "bench" / "data.py").is_file()
    monkeypatch.setenv("RAGBLEND_SHARED_DATA", str(tmp_path))
    assert shared_data("other.json") == tmp_path / "other.json"


def test_passage_texts_take_the_first_passages_with_their_titles():
    example = {"ctxs": [{"title": "Paris", "text": "A city."}, {"text": "No title."}, {}]}
    assert passage_texts(example, 2) == ["Paris\nA city.", "No title."]
