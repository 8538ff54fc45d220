import os
import sys
import tempfile

import pytest

# tests import their slow references (tests/reference_impl.py) by module name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# the tokenized-data cache of training runs (datasets'): the suite's own, not the user's
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(tempfile.gettempdir(), f"iga-ds-tests-{os.getuid()}-datasets"))
_BASELINE = dict(os.environ)


@pytest.fixture(autouse=True)
def _restore_environment():
    """After each test the environment is the session's starting one again: training in this
    process sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ... (also from
    module-scoped fixtures, which run before a per-test snapshot could be taken), and those must
    not reach the processes a later test starts: they would rendezvous on a port this process
    still holds."""
    yield
    for key in set(os.environ) - set(_BASELINE):
        if not key.startswith("PYTEST_"):  # pytest's own bookkeeping
            del os.environ[key]
    os.environ.update(_BASELINE)

