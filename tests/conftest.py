"""Settings every test shares.

Tokenised data is cached (``flowtrain.data.cache``); tests keep their caches in one
temporary folder for the session instead of the user's ``~/.cache/flowtrain``. Subprocesses
inherit the variable.
"""

import os

import pytest

from flowtrain.data.cache import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def data_cache_in_tmp(tmp_path_factory):
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("flowtrain-cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
