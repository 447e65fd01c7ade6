"""The dashboard names the codec the store writes new chunk KV in by the one rule the store
itself reads its configuration by (``kvservice.protocol.codecs.configured_codec``)."""

from __future__ import annotations

import pytest

from kvservice.protocol.codecs import CODECS
from kvservice.store.config import StoreConfig
from webapp.dashboard.selectors import store_codec


@pytest.mark.parametrize("codec", [None, *CODECS])
@pytest.mark.parametrize("quantize", [None, "true", "false"])
def test_the_dashboard_and_the_store_name_the_same_codec(monkeypatch, codec, quantize) -> None:
    for name, value in (("KV_CODEC", codec), ("KV_QUANTIZE", quantize)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    written = StoreConfig.from_env().codec
    assert store_codec() == written
    expected = codec or ("int8" if quantize == "true" else "kivi4k3v-v4early")
    assert written == expected


def test_an_unknown_codec_is_refused_by_both_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("KV_CODEC", "kivi9")
    with pytest.raises(ValueError, match="KV_CODEC: unknown KV codec 'kivi9'") as store:
        StoreConfig.from_env()
    with pytest.raises(ValueError, match="KV_CODEC: unknown KV codec 'kivi9'") as dashboard:
        store_codec()
    assert str(store.value) == str(dashboard.value)
