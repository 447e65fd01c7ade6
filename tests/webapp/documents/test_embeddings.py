"""The embedder: loaded once per process, and warmed up in the background by the web server."""

from __future__ import annotations

from webapp.documents import embeddings


def test_the_embedder_warms_up_in_the_background_before_the_first_question() -> None:
    embeddings._load_embedder.cache_clear()
    thread = embeddings.warm_up_in_background()
    thread.join(180)
    assert not thread.is_alive()
    assert embeddings._load_embedder.cache_info().currsize == 1  # loaded, not on first use
    (vector,) = embeddings.embed_texts(["Where does the Danube flow?"])
    assert len(vector) == embeddings.EMBEDDING_DIM
    assert embeddings._load_embedder.cache_info().misses == 1  # the question reused it
