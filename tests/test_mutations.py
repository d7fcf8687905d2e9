"""The mutation list (`tests/mutations.py`) stays in step with the code: every mutation applies to exactly one piece
of its file, and names test files that exist. Running the mutations themselves is `python tests/mutations.py`."""
from pathlib import Path

import pytest

from tests.mutations import MUTATIONS, ROOT


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_applies_once_and_names_existing_tests(mutation):
    assert (ROOT / mutation.path).read_text().count(mutation.old) == 1, mutation.path
    assert mutation.old != mutation.new
    for spec in mutation.tests:
        assert (ROOT / spec.split()[0].split("::")[0]).is_file(), spec
