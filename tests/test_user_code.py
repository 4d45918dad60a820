"""What counts as the user's own code (never stdlib, packages, stratagem). How a name from a peer is
looked up under these rules is tested in test_remote_code.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stratagem.core import user_code
from stratagem.core.errors import ConfigurationError


def test_user_code_rules():
    assert user_code.is_user_module(sys.modules[__name__]) is (not str(Path(__file__)).startswith(tuple(user_code.installation_roots())))
    with pytest.raises(ConfigurationError, match="own code"):
        user_code.check_importable_user_module("json.decoder")
    with pytest.raises(ConfigurationError, match="cannot be found"):
        user_code.check_importable_user_module("definitely_not_a_module_xyz")
