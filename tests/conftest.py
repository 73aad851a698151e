"""Settings every test shares.

pytest-asyncio before 1.4 sets a fresh event loop after each async test and never closes it;
the next test that replaces the loop (``asyncio.run``) drops it, and the ResourceWarning of its
unclosed socket fails whichever test the garbage collector runs in. The session refuses to
start on such a version instead of failing a test that did nothing wrong.

Tokenised data is cached (``flowtrain.data.cache``); tests keep their caches in one
temporary folder for the session instead of the user's ``~/.cache/flowtrain``. Subprocesses
inherit the variable.
"""

import os
from importlib.metadata import version

import pytest

from flowtrain.data.cache import CACHE_ENV


PYTEST_ASYNCIO_NEEDED = (1, 4)


def pytest_configure(config):
    found = version("pytest-asyncio")
    if tuple(int(p) for p in found.split(".")[:2]) < PYTEST_ASYNCIO_NEEDED:
        raise pytest.UsageError(
            f"pytest-asyncio {found} leaves an event loop open after each async test; "
            f"install pytest-asyncio>={'.'.join(map(str, PYTEST_ASYNCIO_NEEDED))}"
        )


@pytest.fixture(scope="session", autouse=True)
def data_cache_in_tmp(tmp_path_factory):
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("flowtrain-cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
