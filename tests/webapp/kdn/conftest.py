"""The API tests' keys (tests/webapp/api/conftest.py), for the knowledge delivery API too."""

from tests.webapp.api.conftest import alice_auth, mallory_auth  # noqa: F401 (fixtures)
