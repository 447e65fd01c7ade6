"""The engine tests' tiny random checkpoints, for the benches run on them."""

from tests.kvservice.conftest import tiny_checkpoints, tiny_llama  # noqa: F401 (fixtures)
